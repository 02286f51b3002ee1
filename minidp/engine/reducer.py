"""The gradient reducer: one hook per parameter, buckets launched in order as they fill, a finalize.

One synced step: `prepare_for_backward` arms a fresh `Step` (the step's whole state); each
gradient's hook copies it into its bucket, and a bucket that is complete *and next in order* is
launched as an async all-reduce (launching strictly in bucket order keeps every rank issuing the
same collectives in the same order); when backward ends, `finalize` waits for each bucket and
writes its averages back while later buckets are still in flight, and learns whether every rank
succeeded (failures.py: no host read, no collective) before the last bucket. A mode
changes only the readiness policy: step.py's `EveryParameter` is the default's, readiness.py holds
the others. At world size 1 on the default path there are no buckets (one rank's average is its
own).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import failures
from .buckets import Divisor
from .collectives import BACKWARD, FORWARD, JOINED, LIKELY_CAUSES, DesyncCheck, describe_bucket
from .hooks import GradBucket, allreduce_sum_hook, bucket_result, call_comm_hook
from .layout import BucketLayout
from .progress import recorder_for, report
from .step import Step


class Reducer:
    """Averages gradients over `process_group` during backward, bucket by bucket.

    Args:
        params, names: the parameters to reduce, and their names.
        mode: arguments.choose's Mode (the readiness policy; the rest is the layout's).
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
        self.readiness = mode.readiness
        self.world_divisor = Divisor(self.world_size)
        self.comm_hook = None   # None: the default path (allreduce_sum_hook)
        self.comm_state = None  # what the comm hook gets as its `state`
        self.recorder = recorder_for(self.world_size)  # the watchdog's progress, a timeline, or OFF
        self.desync_check = DesyncCheck(process_group) if debug else None
        self.iteration = 0   # synced steps armed
        self.completed = 0   # synced steps completed on every rank
        self.skipped_buckets = 0  # in the last step (skip_all_reduce_unused_params)
        self.step = None  # the armed step, fed by the hooks (None: no_sync, eval, between steps)
        self.open_step = None  # a step whose hooks fired, whose end has not run (a failed one)
        self.status_group = None  # where the status goes; None: process_group (status_on_host)
        self.verdicts = failures.Verdicts()  # each step's NaN flag, on its way to the host
        self.wait_every_step = False  # wait for each flag (failures.same_step_recovery)
        alone = self.world_size == 1
        self.board = None if alone else failures.FailureBoard(process_group, self.rank,
                                                                self.world_size)
        self.layout = BucketLayout(self.params, self.names, mode, process_group=process_group,
                                   allocate=self.world_size > 1 or transport is not None)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self.grad_ready, i))

    # Before the backward: the wrapper's forward calls these, in this order.

    def before_forward(self) -> None:
        """First in every forward: close this rank's failed step, if its last backward raised."""
        self.recorder.forward(self.iteration, armed=False)
        self.close_failed_step()  # ranks meet there only if this rank's last backward raised

    def replan(self) -> None:
        """The one bucket rebuild after the first step (and bucket_cap_mb="auto"'s switches)."""
        self.layout.maybe_replan(self.completed)  # ranks meet there, once

    def prepare_for_backward(self, divisor: Divisor | None = None) -> None:
        """Arm the hooks for the backward after a syncing forward; divisor None: the world size."""
        self.iteration += 1
        divisor = None if self.comm_hook is not None else divisor or self.world_divisor
        self.step = Step(self.layout.buckets, len(self.params), divisor)
        self.recorder.forward(self.iteration, armed=True)

    # The backward: a hook per gradient, buckets launched in order.

    def grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s post-accumulate-grad hook: the hot path, once a gradient a step."""
        step = self.step
        if step is None:
            return  # no_sync(), or a backward without a syncing forward: autograd just accumulates
        if not step.started:
            self._start(step)
        if self.readiness.is_last_hook(step, index):
            self.mark_ready(step, index)

    def _start(self, step: Step) -> None:
        """The first hook of a synced backward: queue finalize."""
        # Runs at the end of this backward, and only if it succeeds (the engine drops it otherwise).
        Variable._execution_engine.queue_callback(self.finalize)
        step.started = True
        self.open_step = step
        self.check_consistency(BACKWARD)  # ranks meet there in debug mode only
        zeros = self.readiness.at_first_hook(step)  # static_graph: this rank's unused parameters
        for index in zeros:
            step.ready[index] = True
            self.reduce_as_zeros(step, index)
        if zeros:
            self.launch_ready_buckets(step)  # ranks meet there, for those parameters' buckets

    def mark_ready(self, step: Step, index: int) -> None:
        """Parameter `index`'s gradient is final this step: into its bucket; launch what is full."""
        step.ready[index] = True
        step.order.append(index)
        self.recorder.grad_ready(self.names[index], self.layout.planned_bucket[index])
        bucket = self.layout.bucket_of[index]
        if bucket is None:
            return  # world size 1: the average of one gradient is itself, where autograd put it
        slot = self.layout.slot_of[index]
        param = self.params[index]
        grad = param.grad
        if grad.is_sparse != bucket.sparse:
            raise RuntimeError(sparse_mismatch(self.names[index], grad.is_sparse))
        if self.layout.copy_later[index] and bucket.holds(slot, grad):
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

        The last bucket waits for the end of a backward that succeeded (`at_end`, from finalize):
        so a rank whose backward raises has always left it unlaunched, close_failed_step sends NaNs
        in it, and every rank finds them in its last reduced bucket (failures.py). It holds the last
        gradients to arrive, so little waits for it.
        """
        buckets = self.layout.buckets
        held_back = 0 if at_end else 1
        while step.launched < len(buckets) - held_back and step.pending[step.launched] == 0:
            bucket = buckets[step.launched]
            if step.waiting[bucket.index]:
                bucket.copy_later(step.waiting[bucket.index], step.divisor)
            self.recorder.launch(self.iteration, bucket.index)
            step.futures.append(self.reduce(bucket, bucket.buffer))  # ranks meet here (async)
            self.recorder.watch(bucket.index, step.futures[-1])

    def _skip(self, step: Step, bucket) -> None:
        """A bucket no parameter of which this rank used (skip_all_reduce_unused_params): no
        collective, no write-back. Those before it launch first, in order."""
        self.launch_ready_buckets(step, at_end=True)
        step.pending[bucket.index] = 0
        done = torch.futures.Future()
        done.set_result(bucket.buffer)
        step.futures.append(done)

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

    # The end of backward.

    def finalize(self) -> None:
        """End of backward: reduce what is left, wait, learn if every rank succeeded, write back."""
        step = self.step
        self.step = None
        self.recorder.event("backward_end", self.iteration)
        buckets = self.layout.buckets
        unlaunched = {b.index: b.param_indices for b in buckets[step.launched:]}
        now, zeros, skipped = self.readiness.at_end(step, unlaunched)  # raises where forbidden
        for index in now:
            self.mark_ready(step, index)
        for index in zeros:
            self.reduce_as_zeros(step, index)
        for index in skipped:
            self._skip(step, buckets[index])
        self.skipped_buckets = len(skipped)  # for model._get_ddp_logging_data()
        self.launch_ready_buckets(step, at_end=True)
        # Each bucket but the last is written back as soon as it is reduced, while later ones are
        # still in flight (as torch's reducer does; on ResNet-50 that hides most of the copies),
        # unless the status exchanged below says which parameters no rank used: then all after it.
        early = self._writes_back_early()  # the same on every rank
        known = self.readiness.after_step(step, None) if early else None  # no status: known now
        results = self._wait_all(step, known[0] if early else None)
        self.open_step = None  # every bucket is reduced: nothing is left for close_failed_step
        failed_ranks, used = self._verdict(step, results)  # ranks meet there with find_unused
        if failed_ranks:
            raise RuntimeError(failures.failed_message(self.rank, self.iteration, failed_ranks))
        self.completed += 1  # the same count on every rank while the layout may change
        unused, order = known or self.readiness.after_step(step, used)
        self.layout.note_ready_order(order)
        first = max(len(results) - 1, 0) if early else 0  # those before it are written back
        for bucket, result in zip(buckets[first:], results[first:]):
            bucket.write_back(result, self.params, unused)
        self.recorder.event("finalize_end", self.iteration)

    def _wait_all(self, step: Step, unused: set | None = None) -> list:
        """Every launched bucket's reduced buffer, in order; given `unused` (the parameters no rank
        used), each but the last is written back as soon as it is reduced."""
        results = []
        for bucket, future in zip(self.layout.buckets, step.futures, strict=True):
            results.append(self._wait(bucket, future))
            if unused is not None and bucket is not self.layout.buckets[-1]:
                bucket.write_back(results[-1], self.params, unused)
        return results

    def _wait(self, bucket, future) -> torch.Tensor:
        """The bucket's reduced buffer; a failure names this rank, the step and the bucket."""
        try:
            value = future.wait()
        except RuntimeError as exc:
            what = f"the all-reduce of bucket {bucket.index}"
            describe = describe_bucket(self.names, self.layout.plan, bucket.index)
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: {what} [{describe}] "
                f"failed; likely {LIKELY_CAUSES} (MINIDP_DEBUG=1 checks every step). "
                f"Cause: {exc}" + report(what)) from exc
        if self.comm_hook is None or bucket.sparse:
            return value[0] if isinstance(value, list) else value  # a collective's: [tensor]
        return bucket_result(value, bucket.buffer, self.comm_hook)

    # The failure protocol (failures.py says why): the failed rank's side, then everyone's verdict.

    def close_failed_step(self) -> None:
        """If this rank's last backward raised mid-step, close the step with the other ranks.

        Also where a flag that arrived since the last step is acted on (a GPU's, failures.py).
        """
        self._learn_verdicts(wait=False)
        step = self.open_step
        if step is None:
            return
        self.step = None
        if self.board is not None:  # first: whoever sees this rank's NaNs finds the post
            self.board.post(self.iteration, self.rank)
        for bucket in self.layout.buckets[step.launched:]:  # ranks meet here: those not launched
            step.futures.append(self.reduce(bucket, failures.failure_payload(bucket)))
        self._wait_all(step)
        if self._needs_status():
            self._exchange_status(step, failed=True)  # ranks meet here
        self.open_step = None
        self.recorder.event("failed_iteration_closed", self.iteration)

    def _verdict(self, step: Step, results: list) -> tuple[list[int], list[int] | None]:
        """(ranks whose backward failed this step, use counts or None): from the status where the
        mode exchanges one, else from this step's NaN flag if it is on the host already."""
        if self._needs_status():
            return self._exchange_status(step, failed=False)  # ranks meet here
        if self.board is None:
            return [], None  # world size 1: nobody else to hear from, no flag to make
        last = results[-1].reshape(-1)
        # A comm hook may move the failed rank's NaNs anywhere in the bucket: look at all of it,
        # by its sum (one read: a NaN anywhere makes it NaN), not isnan().any(), which writes a
        # bool an element and reads it again (49 ms a step for GPT-2's 154 MB last bucket). An
        # inf of each sign sums to NaN too: then the board says nobody failed (one store trip).
        flag = torch.isnan(last.sum()).reshape(1) if self.comm_hook else torch.isnan(last[:1])
        self.verdicts.record(self.iteration, flag)  # computed on the device, read on the host
        wait = self.wait_every_step or self.layout.may_change()
        return self._learn_verdicts(wait, this_step=self.iteration), None

    def _learn_verdicts(self, wait: bool, this_step: int | None = None) -> list[int]:
        """The ranks that failed in `this_step`, from the flags on the host ; earlier: raise."""
        failed_now = []
        for iteration in self.verdicts.arrived(wait):  # steps whose last bucket held a NaN
            failed = self.board.failed_ranks(iteration) if self.board is not None else []
            if failed and iteration == this_step:
                failed_now = failed  # learned before this step's gradients are written back
            elif failed:
                late = failures.late_message(self.rank, iteration, self.iteration, failed)
                raise RuntimeError(late)
        return failed_now

    def _writes_back_early(self) -> bool:
        """Whether buckets are written back as they are reduced: where no status is exchanged (else
        it says which parameters no rank used)."""
        return not self._needs_status()

    def _needs_status(self) -> bool:
        """Whether steps exchange a status (a collective): use counts, or a sparse last bucket,
        which carries no NaN. The same answer on every rank."""
        buckets = self.layout.buckets
        return self.readiness.counts_use or bool(buckets) and buckets[-1].sparse

    def _exchange_status(self, step: Step, failed: bool) -> tuple[list[int], list[int] | None]:
        """All-reduce (ranks whose backward failed, by parameter how many ranks used it)."""
        group = self.status_group or self.process_group  # status_on_host(): gloo, CPU tensors
        device = torch.device("cpu") if self.status_group is not None else self.device
        used = step.ready if self.readiness.counts_use else None
        try:
            return failures.exchange_status(failed, used, self.rank, self.world_size, group, device)
        except RuntimeError as exc:  # ranks met there
            what = "the end-of-backward status all-reduce"
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: {what} failed; "
                f"likely {LIKELY_CAUSES}, or a rank's backward raised and it ran no "
                f"forward afterwards (MINIDP_DEBUG=1 checks every step). Cause: {exc}"
                + report(what)) from exc

    def check_consistency(self, phase: int, joined: bool = False) -> None:
        """Debug mode: every rank checks that all are at the same place (collectives.py)."""
        if self.desync_check is not None:  # ranks meet there
            forward = phase == FORWARD  # before the forward of the next iteration
            iteration = JOINED if joined else self.iteration + forward
            self.desync_check.check(phase, iteration, self.names, self.layout.plan, self.device)

    def match_joined(self) -> None:
        """A rank that has joined (no more data, join.py): one backward's collectives, in zeros."""
        self.check_consistency(BACKWARD, joined=True)  # ranks meet there (debug mode)
        step = Step(self.layout.buckets, len(self.params), divisor=None)
        for bucket in self.layout.buckets:  # ranks meet here: the training ranks' buckets, in order
            step.futures.append(self.reduce(bucket, bucket.zeros()))
        self._wait_all(step)
        failed = self._exchange_status(step, False)[0] if self._needs_status() else []
        self.completed += not failed
        if not failed:
            self.layout.note_ready_order(range(len(self.params)), only_if_none=True)  # as DDP's

    # What the wrapper changes and reads from outside, by method (compat.py, join.py, failures.py).

    def use_comm_hook(self, hook, state) -> None:
        """Reduce each bucket with `hook(state, bucket)` from now on (at world size 1 too)."""
        self.comm_hook, self.comm_state = hook, state
        self.allocate_buckets()  # the hook sees every bucket, as in torch DDP

    def allocate_buckets(self) -> None:
        """Buckets from now on, also at world size 1 (where the default path needs none)."""
        self.layout.allocate_buffers()

    def exchange_status_on(self, group) -> None:
        """The group the status goes over (failures.status_on_host); None: the reducer's."""
        self.status_group = group

    def wait_for_verdicts(self, enabled: bool) -> None:
        """Wait for each step's flag at its end (failures.same_step_recovery)."""
        self.wait_every_step = enabled

    def record_to(self, recorder) -> None:
        """Report to `recorder` (timeline.py's), or None: back to the default."""
        self.recorder = recorder or recorder_for(self.world_size)

    def set_static_graph(self, policy: type) -> None:
        """static_graph=True after construction (torch DDP's _set_static_graph), before training.

        Args:
            policy: readiness.StaticGraph (the class: it is made here, on the reducer's names).
        """
        if self.iteration > 0:
            raise RuntimeError("set_static_graph() should be called before training loop starts "
                               "and after DistributedDataParallel is constructed.")  # torch's words
        self.readiness = policy(self.names)
        self.layout.rebuild_once()  # torch's needs_rebuild, now true

    def first_iteration_plan(self) -> list[list[int]]:
        """The plan of a first iteration with the cap in use (what torch's logger reports)."""
        return self.layout.first_plan()

    def describe(self) -> dict:
        """What the wrapper reports of the reducer: its count, parameters, buckets and hook."""
        return {"iteration": self.iteration, "names": self.names, "params": self.params,
                "plan": self.layout.plan,
                "cap": self.layout.cap, "rebuilt": self.layout.has_rebuilt(),
                "tuner": self.layout.tuner, "comm_hook": self.comm_hook,
                "skipped_buckets": self.skipped_buckets}


def sparse_mismatch(name: str, got_sparse: bool) -> str:
    kinds = ("sparse", "dense") if got_sparse else ("dense", "sparse")
    return (f"minidp: parameter {name!r} has a {kinds[0]} gradient, but a {kinds[1]} one was "
            "expected (only nn.Embedding / nn.EmbeddingBag with sparse=True produce sparse "
            "gradients)")
