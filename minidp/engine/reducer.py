"""The gradient reducer: one hook per parameter, buckets launched in order as they fill, a finalize.

One synced step: `prepare_for_backward` arms a fresh `Step` (the step's whole state); each
gradient's hook copies it into its bucket, and a bucket that is complete *and next in order* is
launched as an async all-reduce (launching strictly in bucket order keeps every rank issuing the
same collectives in the same order); when backward ends, `finalize` waits, checks that every rank
succeeded and writes the averages back. A mode changes only the readiness policy (readiness.py); at
world size 1 on the default path there are no buckets (the average over one rank is the gradient).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import debug as debug_mode
from . import recovery
from .buckets import Divisor
from .hook_checks import bucket_result, call_comm_hook
from .hooks import GradBucket, allreduce_sum_hook
from .layout import BucketLayout
from .sparse import mismatch_message
from .timeline import OFF


class Step:
    """One synced step's state: made when the step is armed, dropped when it ends."""

    def __init__(self, buckets: list, n_params: int, divisor: Divisor | None):
        self.divisor = divisor  # what gradients are divided by as copied in (None: a comm hook's)
        self.pending = [len(b.param_indices) for b in buckets]  # by bucket: gradients to come
        self.waiting = [[] for _ in buckets]  # by bucket: (slot, grad), small, copied at launch
        self.futures = []                     # by launched bucket, in order
        self.ready = [False] * n_params       # by parameter: its gradient is in its bucket
        self.order = []                       # parameters in the order they became ready
        self.started = False  # a hook fired: finalize is queued, collectives may be in flight


class Reducer:
    """Averages gradients over `process_group` during backward, bucket by bucket.

    Args:
        params, names: the parameters to reduce, and their names.
        mode: modes.choose's Mode (the readiness policy; the rest is the layout's).
        process_group (None: the world), debug, transport (None: the group): the wrapper's keywords.
    """

    def __init__(self, params, names, mode, *, process_group, debug, transport):
        self.params = list(params)
        self.names = list(names)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.device = self.params[0].device
        self.transport = transport
        self.debug = debug
        self.readiness = mode.readiness
        self.world_divisor = Divisor(self.world_size)
        self.comm_hook = None   # None: the default path (allreduce_sum_hook)
        self.comm_state = None  # what the comm hook gets as its `state`
        self.recorder = OFF  # timeline.py: a ReducerRecorder while model.enable_timeline() records
        self.iteration = 0   # synced steps armed
        self.completed = 0   # synced steps completed on every rank
        self.step = None  # the armed step, fed by the hooks (None: no_sync, eval, between steps)
        self.open_step = None  # a step whose hooks fired, whose end has not run (recovery.py)
        self.status_group = None  # where the status goes; None: process_group (status_on_host)
        self.layout = BucketLayout(self.params, self.names, mode, process_group=process_group,
                                   allocate=self.world_size > 1 or transport is not None)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self.grad_ready, i))

    def prepare_for_backward(self, divisor: Divisor | None = None) -> None:
        """Arm the hooks for the backward after a syncing forward; divisor None: the world size."""
        self.iteration += 1
        divisor = None if self.comm_hook is not None else divisor or self.world_divisor
        self.step = Step(self.layout.buckets, len(self.params), divisor)

    def grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s post-accumulate-grad hook: the hot path, once a gradient a step."""
        step = self.step
        if step is None:
            return  # no_sync(), or a backward without a syncing forward: autograd just accumulates
        if not step.started:
            self._start(step)
        if self.readiness.is_last_hook(step, index):
            self.mark_ready(step, index, param)

    def _start(self, step: Step) -> None:
        """The first hook of a synced backward: queue finalize."""
        # Runs at the end of this backward, and only if it succeeds (the engine drops it otherwise).
        Variable._execution_engine.queue_callback(self.finalize)
        step.started = True
        self.open_step = step
        debug_mode.check_step(self, debug_mode.BACKWARD)  # ranks meet here in debug mode only
        self.readiness.at_first_hook(self, step)

    def mark_ready(self, step: Step, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s gradient is final this step: into its bucket; launch what is full."""
        step.ready[index] = True
        step.order.append(index)
        self.recorder.grad_ready(index)
        bucket = self.layout.bucket_of[index]
        if bucket is None:
            return  # world size 1: the average of one gradient is itself, where autograd put it
        slot = self.layout.slot_of[index]
        grad = param.grad
        if grad.is_sparse != bucket.sparse:
            raise RuntimeError(mismatch_message(self.names[index], grad.is_sparse))
        if self.layout.copy_later[index]:
            step.waiting[bucket.index].append((slot, grad))
        else:
            bucket.copy_in(slot, param, grad, step.divisor)
        step.pending[bucket.index] -= 1
        if step.pending[bucket.index] == 0:
            self.launch_ready_buckets(step)

    def reduce_as_zeros(self, step: Step, index: int) -> None:
        """Parameter `index` has no gradient on this rank: it contributes zeros to its bucket."""
        bucket = self.layout.bucket_of[index]
        if bucket is not None:
            bucket.zero_slot(self.layout.slot_of[index])
            step.pending[bucket.index] -= 1

    def launch_ready_buckets(self, step: Step, at_end: bool = False) -> None:
        """Launch complete buckets strictly in index order: every rank issues the same sequence.

        The last bucket is launched only at the end of a backward that succeeded (`at_end`, from
        finalize), never by a hook: so a rank whose backward raises has always left it for
        close_failed_step, which sends NaNs in it, and every rank learns of the failure from the
        reduced bucket itself (end_step). It holds the last gradients to arrive, so little waits.
        """
        buckets = self.layout.buckets
        launchable = len(buckets) if at_end else len(buckets) - 1
        while len(step.futures) < launchable and step.pending[len(step.futures)] == 0:
            bucket = buckets[len(step.futures)]
            if step.waiting[bucket.index]:
                bucket.copy_later(step.waiting[bucket.index], step.divisor)
            self.recorder.launch(bucket.index)
            step.futures.append(self.reduce(bucket, bucket.buffer))  # ranks meet here (async)
            self.recorder.watch(bucket.index, step.futures[-1])

    def reduce(self, bucket, buffer: torch.Tensor) -> torch.futures.Future:
        """Start reducing `buffer` as `bucket`: by the comm hook, the transport, or the default."""
        params = [self.params[i] for i in bucket.param_indices]
        is_last = bucket.index == len(self.layout.buckets) - 1
        grad_bucket = GradBucket(bucket.index, buffer, params, bucket.offsets, is_last=is_last)
        if self.comm_hook is not None:  # ranks meet here (async)
            return call_comm_hook(self.comm_hook, self.comm_state, grad_bucket)
        if self.transport is not None:  # ranks meet here (async), on the transport's wires
            return self.transport.all_reduce(buffer)
        return allreduce_sum_hook(self.process_group, grad_bucket)  # ranks meet here (async)

    def finalize(self) -> None:
        """End of backward: reduce what is left, wait, check every rank succeeded, write back."""
        step = self.step
        self.step = None
        self.recorder.event("backward_end")
        for index in self.readiness.missing_at_end(self, step):  # raises where the mode forbids
            self.reduce_as_zeros(step, index)
        self.launch_ready_buckets(step, at_end=True)
        results, failed_ranks, used = self.end_step(step, failed=False)
        if failed_ranks:
            raise RuntimeError(recovery.failed_message(self, failed_ranks))
        unused, order = self.readiness.after_step(step, used)
        self.layout.note_ready_order(order)
        for bucket, result in zip(self.layout.buckets, results):
            bucket.write_back(result, self.params, unused)
        self.recorder.event("finalize_end")

    def end_step(self, step: Step, failed: bool):
        """Wait for every bucket, then learn whether any rank's backward failed; the step is closed.

        What this adds to torch DDP's step, and why: a rank whose backward raised closes the step at
        its next forward (recovery.close_failed_step) with NaNs in the buckets it had not launched,
        the last one always among them; so on every rank the last reduced bucket starts with a NaN.
        Only then (or when a gradient there is NaN itself) do the ranks exchange a status: who
        failed. The default step issues no collective that torch DDP's does not, and reads one
        element on the host (free on gloo, whose wait has blocked already). find_unused_parameters
        always exchanges it (it counts each parameter's users, as torch's unused-parameter
        all-reduce does); a comm hook too, after the hooks, as its result may not carry a NaN.

        Returns:
            (reduced buffers by bucket, failed group ranks, per-parameter use counts or None)
        """
        futures = zip(self.layout.buckets, step.futures, strict=True)
        results = [self._wait(bucket, future) for bucket, future in futures]
        failed_ranks = []
        used = None
        if recovery.status_needed(self, results):  # ranks meet there
            failed_ranks, used = recovery.exchange_status(self, step, failed)
        self.open_step = None
        self.completed += not failed_ranks  # the same count on every rank
        return results, failed_ranks, used

    def _wait(self, bucket, future) -> torch.Tensor:
        """The bucket's reduced buffer; a failure names this rank, the step and the bucket."""
        try:
            value = future.wait()
        except RuntimeError as exc:
            raise RuntimeError(recovery.wait_failed_message(self, bucket, exc)) from exc
        if self.comm_hook is None or bucket.sparse:
            return value[0] if isinstance(value, list) else value  # a collective's: [tensor]
        return bucket_result(value, bucket.buffer, self.comm_hook)
