"""The gradient reducer: per-parameter hooks, in-order async launch, end-of-backward finalize.

One iteration, as the code runs it:
  1. `prepare_for_backward()` (called by the wrapper after a forward that will sync) resets the
     per-iteration state.
  2. Backward accumulates each parameter's gradient; its post-accumulate hook copies it into the
     bucket (scaled by 1/world_size on the default path) and counts the bucket down.
  3. When a bucket is complete *and all buckets before it have been launched*, its comm hook
     starts an async all-reduce. Launching strictly in bucket order keeps every rank issuing the
     same collectives in the same order, whatever order their gradients arrive in.
  4. The autograd engine's end-of-backward callback (queued by the first hook) launches what is
     left, waits for every bucket, exchanges the iteration's status (did every rank's backward
     succeed?) and writes the averaged gradients back.

World size 1 on the default path (no comm hook, no transport): averaging over one rank is the
identity, so nothing is copied or communicated; the hooks only check and record (the unused-parameter
error, the timeline), the gradients stay where autograd put them (`reduce_locally`).

A backward that raises (an error in the model, an out-of-memory caught and retried) skips step 4
on that rank, possibly after launching some buckets; `prepare_for_forward` keeps the ranks in step.
Which bucket each gradient goes to, and when that changes, is layout.py's (planned by planning.py's
rules); the buffers, the copies in and the write-back into `.grad` are in buckets.py.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import debug as debug_mode
from .buckets import (
    Bucket,
    check_sparse_backend,
    copy_deferred,
    copy_in,
    no_sparse_gradient,
    sparse_gradient_flags,
    write_back,
)
from .hooks import GradBucket, allreduce_sum_hook, bucket_result, call_comm_hook, hook_name
from .layout import BucketLayout
from .static_graph import StaticGraph

SMALL_GRAD_NUMEL = 65536  # gradients below this are copied into the bucket in one batch


class Reducer:
    """Averages gradients over `process_group` during backward, bucket by bucket.

    Args:
        params: the parameters to reduce (unique, requires_grad).
        names: their names, for error messages.
        The rest as the wrapper's keywords (keyword-only):
        process_group: the group to average over. Default None: the world.
        bucket_cap_mb: DDP's bucket_cap_mb, or "auto" (layout.py). Default None: 25 MiB, first 1 MiB.
        find_unused_parameters: reduce parameters that got no gradient as zeros. Default False.
        gradient_as_bucket_view: make each `.grad` a view into its bucket (no copy back). Default False.
        static_graph: as DDP's: the same parameters are used, as often, every iteration (static_graph.py).
            Default False.
        debug: debug mode's consistency checks (see check_consistency). Default False.
        expect_sparse_gradient: by parameter, whether its gradient is sparse
            (buckets.sparse_gradient_flags). Default: none is.
        transport: a minidp.comm transport for the default path's all-reduce. Default None: process_group.
    """

    def __init__(self, params, names, *, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, debug=False, expect_sparse_gradient=(),
                 transport=None):
        self.params, self.names, self.process_group = list(params), list(names), process_group
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.device = self.params[0].device
        self.sparse = list(expect_sparse_gradient) or [False] * len(self.params)
        check_sparse_backend(self.params, self.names, self.sparse, dist.get_backend(process_group))
        if transport is not None and any(self.sparse):
            raise ValueError(f"transport={transport!r} carries dense buckets only, but parameter "
                             f"{self.names[self.sparse.index(True)]} has a sparse gradient")
        self.transport = transport  # None: the default path's all-reduce runs on process_group
        self.find_unused_parameters, self.gradient_as_bucket_view = find_unused_parameters, gradient_as_bucket_view
        self.debug = debug
        self.static = StaticGraph(self.names) if static_graph else None  # static_graph=True's hook counts
        self.comm_hook, self.comm_state = None, None  # None: the default path (allreduce_sum_hook)
        # One rank, default path: the average is the gradient itself; no buffers, copies or collectives.
        self.reduce_locally = self.world_size == 1 and transport is None
        self.timeline = None  # a minidp.timeline.Timeline while recording, else None (zero cost)
        self.iteration, self.completed = 0, 0  # synced backwards prepared / completed on every rank
        # Gradients are divided by `divisor` (multiplied by `scale` = 1/divisor, in float64 as DDP's
        # reciprocal): the world size, or under join() a count on the device.
        self.divisor, self.scale, self.divisor_work = self.world_size, 1.0 / self.world_size, None
        self.expect_hooks = False  # True between a syncing forward and the end of its backward
        # reducing: a gradient hook fired in this iteration, so collectives may be in flight; the
        # iteration is open until _finalize (or, after a failed backward, prepare_for_forward) closes it.
        self.reducing, self.ready, self.next_bucket = False, [False] * len(self.params), 0
        # Small gradients cost a Python-issued op each: they are copied in one batch at launch.
        self.small = [p.numel() < SMALL_GRAD_NUMEL for p in self.params]
        # The buckets (layout.py): torch's initial plan; rebuilt once, in gradient-ready order, after the
        # first iteration when torch's `needs_rebuild`; re-planned in the first iterations with "auto".
        self.layout = BucketLayout(self.params, self.names, self.sparse, bucket_cap_mb=bucket_cap_mb,
                                   needs_rebuild=static_graph or not find_unused_parameters,
                                   process_group=process_group, allocate=not self.reduce_locally,
                                   gradient_as_bucket_view=gradient_as_bucket_view)
        for i, p in enumerate(self.params):
            # The bound method itself, with its index: no wrapper frame per gradient.
            p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

    sparse_gradient_flags = staticmethod(sparse_gradient_flags)  # for the wrapper's call

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket)`, which gets the gradients unscaled (DDP's contract).

        The wrapper checks the hook's signature first (hooks.check_comm_hook); one hook per reducer.
        """
        if self.comm_hook is not None:
            raise RuntimeError("register_comm_hook can only be called once: a communication hook is "
                               f"registered already ({hook_name(self.comm_hook)})")
        self.comm_hook, self.comm_state = hook, state
        if self.reduce_locally:  # world size 1: now there are buckets, and the hook sees every one (DDP)
            self.reduce_locally = False
            self.layout.allocate_buffers()

    def set_static_graph(self) -> None:
        """static_graph=True after construction (torch DDP's _set_static_graph), before the first iteration."""
        if self.iteration > 0:
            raise RuntimeError("set_static_graph() should be called before training loop starts and after "
                               "DistributedDataParallel is constructed.")  # torch's words
        self.static = StaticGraph(self.names)
        self.layout.needs_rebuild = self.layout.rebuild_pending = True  # torch's needs_rebuild, now true

    def check_consistency(self, phase: int) -> None:
        """Debug mode: every rank checks that all are in the same iteration with the same buckets.

        Args:
            phase: debug.FORWARD (before a syncing forward's collectives) or debug.BACKWARD (before
                the first bucket). Without debug mode, nothing.
        """
        if not self.debug or self.world_size == 1:
            return  # one rank agrees with itself
        # Before a forward, the iteration it starts; before the first bucket, the one under way.
        iteration, bucket = (self.iteration, 0) if phase == debug_mode.BACKWARD else (self.iteration + 1, None)
        debug_mode.check(phase, iteration, self.layout.plan, self.process_group, self.device, bucket,
                         self.layout.describe)  # ranks meet here (debug mode only)

    @property
    def buckets(self) -> list:
        """The current buckets, in launch order (empty when gradients are reduced locally)."""
        return self.layout.buckets

    def maybe_rebuild(self) -> bool:
        """Before a forward: rebuild the buckets after the first synced iteration, step the cap tuner."""
        return self.layout.maybe_replan(self.completed)  # ranks meet here when it re-plans

    # ---- one iteration ------------------------------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Called first in every forward: close an iteration whose backward raised on this rank.

        Why: a backward that raises after its first gradient hook may have launched only some of the
        iteration's bucket all-reduces on this rank, while ranks whose backward succeeded launched all
        of them and now wait for this rank. Before this rank issues any other collective (which would
        pair with theirs), it launches the missing buckets (zeros) and reports the failure in the
        iteration's status all-reduce. Every rank then discards the iteration, and ranks whose
        backward had succeeded raise from it too: every rank's loop sees the same error, skips the
        same optimizer step, and the ranks stay equal. Zeros rather than a partial buffer: the values
        are discarded everywhere, they only need to be defined.
        """
        if not self.reducing:
            return
        self.expect_hooks = False
        for bucket in self.layout.buckets[self.next_bucket:]:
            if bucket.sparse:
                bucket.buffer = no_sparse_gradient(bucket.buffer)
            else:
                bucket.buffer.zero_()
            bucket.pending, bucket.deferred, bucket.in_place = 0, [], []
        self._launch_ready_buckets()  # ranks meet here: the buckets this rank had not launched
        self._end_iteration(failed=True, ready=self.ready)
        if self.timeline is not None:
            self.timeline.record("failed_iteration_closed")

    def prepare_for_backward(self, divisor_work=None) -> None:
        """Arm the hooks for the next backward (called after a forward that syncs).

        Args:
            divisor_work: under join(divide_by_initial_world_size=False), the async all-reduce
                that counts the ranks still training; gradients are divided by that count.
        """
        self.iteration += 1
        self.divisor, self.scale, self.divisor_work = self.world_size, 1.0 / self.world_size, divisor_work
        self.ready = [False] * len(self.params)
        if self.static is not None:
            self.static.start_iteration()
        for bucket in self.layout.buckets:
            bucket.pending, bucket.future, bucket.deferred, bucket.in_place = len(bucket.param_indices), None, [], []
        self.next_bucket, self.expect_hooks = 0, True

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s post-accumulate-grad hook: count its bucket down, launch what is complete.

        The hot path (once per gradient per step): two Python frames (this and _mark_ready), small
        gradients only queued.
        """
        if not self.expect_hooks:  # no_sync(), or a backward without a wrapped forward: just accumulate
            return
        if not self.reducing:
            self._start_reducing()
        if self.static is not None:
            if not self.static.last_hook(index):
                return  # static_graph: more hooks of this parameter to come (or the first iteration)
        elif self.ready[index]:
            raise RuntimeError(f"minidp: parameter {self.names[index]!r} got a gradient twice in one "
                               "backward; each parameter may be reduced once per iteration (unless "
                               "static_graph=True, e.g. for reentrant activation checkpointing)")
        self._mark_ready(index, param)

    def _mark_ready(self, index: int, param: torch.Tensor) -> None:
        """Parameter `index`'s gradient is final for this iteration: into its bucket; launch what is complete."""
        self.ready[index] = True
        layout = self.layout
        if layout.rebuild_pending:
            layout.ready_order.append(index)
        if self.timeline is not None:
            self.timeline.record("grad_ready", param=self.names[index], bucket=layout.bucket_index_of[index])
        if self.reduce_locally:
            return  # world size 1: the average of one gradient is itself, where autograd put it
        bucket, slot, grad = layout.bucket_of[index], layout.slot_of[index], param.grad
        if grad.is_sparse != bucket.sparse:
            raise RuntimeError(_sparse_mismatch(self.names[index], grad.is_sparse))
        if self.small[index] and not bucket.sparse and not self.gradient_as_bucket_view:
            bucket.deferred.append((slot, grad, param))  # copied at launch (copy_deferred)
        else:
            copy_in(bucket, slot, param, grad, average=self.comm_hook is None, divisor=self.divisor,
                    scale=self.scale, small=self.small[index], as_bucket_view=self.gradient_as_bucket_view)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _start_reducing(self) -> None:
        """The first gradient of a synced backward: queue the end-of-backward callback."""
        # Runs at the end of this backward, and only if it succeeds (the engine drops it otherwise).
        Variable._execution_engine.queue_callback(self._finalize)
        self.reducing = True
        if self.divisor_work is not None:  # join(): divide by the ranks still training
            self.divisor_work.wait()
            # Kept on the device (no .item(), which would wait for the GPU mid-backward).
            self.divisor = self.divisor_work.result()[0].reshape(())
            self.scale = 1.0 / self.divisor.double()
        if self.static is not None and not self.static.learning:  # static_graph: the unused are ready now
            for i in self.static.unused:
                self.ready[i] = True
                if self.layout.buckets:
                    self._reduce_as_zeros(i)
            self._launch_ready_buckets()  # ranks meet here, for buckets of unused parameters only

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets strictly in index order: every rank issues the same sequence."""
        while self.next_bucket < len(self.layout.buckets) and self.layout.buckets[self.next_bucket].pending == 0:
            bucket = self.layout.buckets[self.next_bucket]
            copy_deferred(bucket, average=self.comm_hook is None, divisor=self.divisor, scale=self.scale,
                          as_bucket_view=self.gradient_as_bucket_view)
            if bucket.index == 0:
                self.check_consistency(debug_mode.BACKWARD)
            if self.timeline is not None:
                self.timeline.record("launch", bucket=bucket.index)
            bucket.future = self._reduce(bucket, bucket.buffer)  # ranks meet here (async)
            if self.timeline is not None:
                self.timeline.watch(bucket.future, device=self.device, bucket=bucket.index)
            self.next_bucket += 1

    def _reduce(self, bucket: Bucket, buffer: torch.Tensor) -> torch.futures.Future:
        """Start reducing `buffer` as `bucket` through the comm hook; the one place a GradBucket is made."""
        grad_bucket = GradBucket(bucket.index, buffer, [self.params[i] for i in bucket.param_indices],
                                 bucket.offsets, is_last=bucket.index == len(self.layout.buckets) - 1)
        if self.comm_hook is None and self.transport is not None:
            return self.transport.all_reduce(buffer)  # ranks meet here (async), on the transport's wires
        if self.comm_hook is None:
            return allreduce_sum_hook(self.process_group, grad_bucket)  # ranks meet here (async)
        return call_comm_hook(self.comm_hook, self.comm_state, grad_bucket)  # ranks meet here (async)

    def _finalize(self) -> None:
        """End of backward: reduce what is left, agree that every rank succeeded, write gradients back."""
        self.expect_hooks = False
        if self.timeline is not None:
            self.timeline.record("backward_end")
        learning = self.static is not None and self.static.learning
        if learning:  # static_graph's first iteration: every gradient into its bucket now
            for i, count in enumerate(self.static.counts):
                if count:
                    self._mark_ready(i, self.params[i])
        missing = [i for i, r in enumerate(self.ready) if not r]
        if missing and not self._counts_use():
            # A failed backward like any other: the next forward closes the iteration (prepare_for_forward).
            raise RuntimeError(self.static.missing_message(missing) if self.static is not None
                               else _unused_message([self.names[i] for i in missing]))
        for i in missing if self.layout.buckets else ():  # unused here (find_unused_parameters): zeros from this rank
            self._reduce_as_zeros(i)
        self._launch_ready_buckets()
        results, failed_ranks, used = self._end_iteration(failed=False, ready=self.ready)
        if failed_ranks:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: the backward of iteration {self.iteration} raised on rank(s) "
                f"{failed_ranks}, so every rank discards this iteration's gradients (none were averaged). "
                "Skip optimizer.step() and call optimizer.zero_grad(), as those ranks do after their own "
                "error, then go on: the ranks stay equal.")
        if learning:
            self.static.learn(used)
            self.layout.ready_order = []  # as torch: the buckets are rebuilt after the second iteration
        elif self.static is not None and self.layout.rebuild_pending:
            self.layout.ready_order.extend(self.static.unused)  # this rank's unused parameters last, as torch
        if self.static is not None:
            globally_unused = self.static.globally_unused  # learned in the first iteration, as torch
        else:
            globally_unused = {i for i, count in enumerate(used) if count == 0} if used is not None else set()
        for bucket, result in zip(self.layout.buckets, results):
            write_back(bucket, result, self.params, self.gradient_as_bucket_view, globally_unused)
        if self.timeline is not None:
            self.timeline.record("finalize_end")

    def _reduce_as_zeros(self, i: int) -> None:
        """Parameter i has no gradient on this rank: it contributes zeros to its bucket."""
        bucket = self.layout.bucket_of[i]
        if bucket.sparse:
            bucket.buffer = no_sparse_gradient(bucket.buffer)
        else:
            bucket.views[self.layout.slot_of[i]].zero_()
        bucket.pending -= 1

    def _counts_use(self) -> bool:
        """Whether this iteration's status counts, by parameter, the ranks that used it (then unused is allowed)."""
        return self.static.learning if self.static is not None else self.find_unused_parameters

    def _end_iteration(self, failed: bool, ready: list[bool]):
        """Wait for every bucket, exchange the iteration's status (ranks meet here), close the iteration.

        The status all-reduce holds one flag per rank (did its backward fail?) and, with
        find_unused_parameters, how many ranks produced each parameter's gradient. On the default
        path it starts right behind the last bucket and overlaps their reduction; a registered hook
        may issue collectives from its futures' callbacks (PowerSGD does), so then it starts only
        once every bucket is done: else ranks could order the two differently.

        Returns:
            (reduced buffers by bucket, failed group ranks, per-parameter use counts or None)
        """
        status = self._start_status(failed, ready) if self.comm_hook is None else None
        results = [self._wait(bucket) for bucket in self.layout.buckets]
        status, work = status or self._start_status(failed, ready)
        try:
            if work is not None:
                work.wait()
        except RuntimeError as exc:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: the end-of-backward status "
                f"all-reduce failed; likely {debug_mode.LIKELY_CAUSES}, or a rank's backward raised and it "
                f"ran no forward afterwards (MINIDP_DEBUG=1 checks every step). Cause: {exc}") from exc
        # The one host read per iteration (free on gloo, whose wait already blocked; on CUDA it waits for
        # the reduction): whether to raise is a decision of the host.
        counts = status.tolist()
        failed_ranks = [r for r in range(self.world_size) if counts[r]]
        self.reducing = False
        self.completed += not failed_ranks  # the same count on every rank: the tuner steps by it
        for bucket in self.layout.buckets:
            bucket.future, bucket.deferred, bucket.in_place = None, [], []
        if failed_ranks and self.layout.rebuild_pending:
            # Every rank drops the failed iteration's ready order, so all rebuild after the same iteration.
            self.layout.ready_order = []
        return results, failed_ranks, counts[self.world_size:] or None

    def _start_status(self, failed: bool, ready: list[bool]):
        counts_use = self._counts_use()
        status = torch.zeros(self.world_size + len(self.params) * counts_use, dtype=torch.int32, device=self.device)
        status[self.rank] = int(failed)
        if counts_use:
            status[self.world_size:] = torch.tensor(ready, dtype=torch.int32)
        if self.world_size == 1:
            return status, None  # one rank: the sum is this rank's status itself
        return status, dist.all_reduce(status, group=self.process_group, async_op=True)  # ranks meet here

    def _wait(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's reduced buffer; a failure names this rank, the iteration and the bucket."""
        try:
            value = bucket.future.wait()
        except RuntimeError as exc:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: the all-reduce of bucket "
                f"{bucket.index} [{self.layout.describe(bucket.index)}] failed; likely "
                f"{debug_mode.LIKELY_CAUSES} (MINIDP_DEBUG=1 checks every step). Cause: {exc}") from exc
        if self.comm_hook is None or bucket.sparse:
            return value[0] if isinstance(value, list) else value  # a collective's future holds [tensor]
        return bucket_result(value, bucket.buffer, self.comm_hook)

    def shadow_backward(self) -> None:
        """For a rank that has joined (no more data): match one backward's collectives with zeros."""
        debug_mode.check_joined(self, debug_mode.BACKWARD)  # ranks meet here (debug mode only), as bucket 0 does
        for bucket in self.layout.buckets:  # ranks meet here: the same buckets, in the same order, as training ranks
            zeros = no_sparse_gradient(bucket.buffer) if bucket.sparse else torch.zeros_like(bucket.buffer)
            bucket.future = self._reduce(bucket, zeros)
        _, failed_ranks, _ = self._end_iteration(failed=False, ready=[False] * len(self.params))
        if self.layout.rebuild_pending and not failed_ranks and not self.layout.ready_order:
            self.layout.ready_order = list(range(len(self.params)))  # as DDP: a joined rank votes for the default


def _sparse_mismatch(name: str, got_sparse: bool) -> str:
    kinds = ("sparse", "dense") if got_sparse else ("dense", "sparse")
    return (f"minidp: parameter {name!r} has a {kinds[0]} gradient, but a {kinds[1]} one was expected (only "
            "nn.Embedding / nn.EmbeddingBag with sparse=True produce sparse gradients)")


def _unused_message(names: list[str]) -> str:
    return (f"minidp.DDP: {len(names)} parameter(s) got no gradient in the last backward: {names}. "
            "Every parameter must take part in the loss each iteration; otherwise pass "
            "find_unused_parameters=True (unused parameters are then reduced as zeros).")
