"""The gradient reducer: flat bucket buffers, per-parameter hooks, async launch, end-of-backward finalize.

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

A backward that raises (an error in the model, an out-of-memory caught and retried) skips step 4
on that rank, possibly after launching some buckets; see `prepare_for_forward` for how the ranks
stay in step and equal.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd import Variable

from . import debug as debug_mode
from . import planning
from .collectives import global_rank
from .hooks import GradBucket, allreduce_sum_hook

SMALL_GRAD_NUMEL = 65536  # gradients below this are copied into the bucket in one batch


@dataclass
class Bucket:
    """A flat buffer holding some parameters' gradients back to back, and its per-iteration state.

    A parameter with a sparse gradient has a bucket of its own, whose `buffer` is that gradient itself
    (set each iteration; sparse tensors cannot be packed into a flat buffer), with no views.
    """

    index: int
    param_indices: list[int]      # into Reducer.params, in buffer order
    offsets: list[int]            # element offset of each gradient in `buffer`
    buffer: torch.Tensor
    views: list[torch.Tensor]     # buffer slices shaped like the parameters
    sparse: bool = False
    pending: int = 0              # gradients still to arrive this iteration
    deferred: list = field(default_factory=list, repr=False)  # (slot, grad, param) to copy at launch
    future: torch.futures.Future | None = field(default=None, repr=False)


class Reducer:
    """Averages gradients over `process_group` during backward, bucket by bucket.

    Args:
        params: the parameters to reduce (unique, requires_grad).
        names: their names, for error messages.
        process_group: the group to average over.
        bucket_cap_mb: DDP's bucket_cap_mb (None: 25 MiB with a 1 MiB first bucket).
        find_unused_parameters: reduce parameters that got no gradient as zeros.
        gradient_as_bucket_view: make each `.grad` a view into its bucket (no copy back).
        static_graph: as DDP's; here it only selects the same bucket policy as the default.
        debug: run debug mode's consistency check before each backward's first bucket.
        expect_sparse_gradient: by parameter, whether its gradient is sparse (see
            `Reducer.sparse_gradient_flags`). Default: none is.
    """

    def __init__(self, params, names, process_group, bucket_cap_mb=None, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False, debug=False, expect_sparse_gradient=()):
        self.params, self.names, self.group = list(params), list(names), process_group
        self.device = self.params[0].device
        self.sparse = list(expect_sparse_gradient) or [False] * len(self.params)
        _check_sparse_backend(self.params, self.names, self.sparse, process_group)
        self.world_size, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.iteration, self.debug = 0, debug  # iteration: synced backwards prepared so far
        self.divisor, self.divisor_work = self.world_size, None  # join() may shrink the divisor
        self.bucket_cap_mb, self.find_unused = bucket_cap_mb, find_unused_parameters
        self.as_view, self.static_graph = gradient_as_bucket_view, static_graph
        self.comm_hook, self.comm_state, self.custom_hook = allreduce_sum_hook, process_group, False
        self.timeline = None  # a minidp.timeline.Timeline while recording, else None (zero cost)
        self.expect_hooks = False  # True between a syncing forward and the end of its backward
        self.ready = [False] * len(self.params)
        self.ready_order: list[int] = []  # first synced iteration: the order gradients arrived in
        self.rebuilt = not (static_graph or not find_unused_parameters)  # DDP rebuilds only then
        # reducing: a gradient hook fired in this iteration, so collectives may be in flight; the
        # iteration is open until _finalize (or, after a failed backward, prepare_for_forward) closes it.
        self.next_bucket, self.reducing = 0, False
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        limits = planning.bucket_limits(bucket_cap_mb, True, find_unused_parameters, static_graph)
        self._build(planning.plan_initial(sizes, keys, limits, self.sparse))
        self.handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                        for i, p in enumerate(self.params)]

    @staticmethod
    def sparse_gradient_flags(module: torch.nn.Module, params: list) -> list[bool]:
        """By parameter, whether its gradient will be sparse; DDP's rule: its module is an nn.Embedding or
        nn.EmbeddingBag with sparse=True (for a shared parameter, the first module that has it)."""
        sparse_owner: dict = {}
        for sub in module.modules():
            for p in sub.parameters(recurse=False):
                sparse_owner.setdefault(p, isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse)
        return [sparse_owner.get(p, False) for p in params]

    # ---- bucket layout -------------------------------------------------------------------------

    def _build(self, plan: list[list[int]]) -> None:
        """Allocate one flat buffer per planned bucket (once per layout, never per step)."""
        self.buckets, self.bucket_of, self.slot_of = [], [None] * len(self.params), [0] * len(self.params)
        for b, indices in enumerate(plan):
            first = self.params[indices[0]]
            if self.sparse[indices[0]]:
                bucket = Bucket(b, list(indices), [0], _no_sparse_gradient(first), [], sparse=True)
                self.bucket_of[indices[0]], self.slot_of[indices[0]] = bucket, 0
                self.buckets.append(bucket)
                continue
            offsets, total = [], 0
            for i in indices:
                offsets.append(total)
                total += self.params[i].numel()
            # Empty, not zeros: every slot is written (gradient or zeros) before each all-reduce.
            buffer = torch.empty(total, dtype=first.dtype, device=first.device)
            views = [buffer[o:o + self.params[i].numel()].view_as(self.params[i])
                     for i, o in zip(indices, offsets)]
            bucket = Bucket(b, list(indices), offsets, buffer, views)
            for slot, i in enumerate(indices):
                self.bucket_of[i], self.slot_of[i] = bucket, slot
                grad = self.params[i].grad
                if self.as_view and grad is not None:  # adopt the existing gradient, as DDP does
                    views[slot].copy_(grad)
                    self.params[i].grad = views[slot]
            self.buckets.append(bucket)

    def bucket_plan(self) -> list[list[str]]:
        """The current layout by parameter name, in launch order (for reading and tests)."""
        return [[self.names[i] for i in b.param_indices] for b in self.buckets]

    def maybe_rebuild(self) -> bool:
        """After the first synced iteration, re-plan buckets in gradient-ready order (once)."""
        if self.rebuilt or not self.ready_order:
            return False
        if len(self.ready_order) != len(self.params):
            raise RuntimeError(f"minidp: cannot rebuild buckets: {len(self.ready_order)} of "
                               f"{len(self.params)} gradients were recorded in the first iteration")
        order = torch.tensor(self.ready_order, dtype=torch.int64, device=self.device)
        # Ranks meet here: all ranks adopt rank 0's order, so their layouts agree.
        dist.broadcast(order, src=global_rank(self.group, 0), group=self.group)
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        limits = planning.bucket_limits(self.bucket_cap_mb, False, self.find_unused, self.static_graph)
        self._build(planning.plan_rebuilt(sizes, keys, limits, order.tolist(), self.sparse))
        self.rebuilt, self.ready_order = True, []
        return True

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
        for bucket in self.buckets[self.next_bucket:]:
            self._fill_with_zeros(bucket)
            bucket.pending, bucket.deferred = 0, []
        self._launch_ready_buckets()  # ranks meet here: the buckets this rank had not launched
        self._end_iteration(failed=True)
        if self.timeline is not None:
            self.timeline.record("failed_iteration_closed")

    raise_if_failed = prepare_for_forward  # the name ddp.py calls today

    def prepare_for_backward(self, divisor_work=None) -> None:
        """Arm the hooks for the next backward (called after a forward that syncs).

        Args:
            divisor_work: under join(divide_by_initial_world_size=False), the async all-reduce
                that counts the ranks still training; gradients are divided by that count.
        """
        self.iteration += 1
        self.divisor, self.divisor_work = self.world_size, divisor_work
        self.ready = [False] * len(self.params)
        for bucket in self.buckets:
            bucket.pending, bucket.future, bucket.deferred = len(bucket.param_indices), None, []
        self.next_bucket, self.expect_hooks = 0, True

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if self.expect_hooks:  # no_sync(), or a backward without a wrapped forward: just accumulate
                self._grad_ready(index, param)
        return hook

    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self.ready[index]:
            raise RuntimeError(f"minidp: parameter {self.names[index]!r} got a gradient twice in one "
                               "backward; each parameter may be reduced once per iteration")
        if not self.reducing:
            # Runs at the end of this backward, and only if it succeeds (the engine drops it otherwise).
            Variable._execution_engine.queue_callback(self._finalize)
            self.reducing = True
            if self.divisor_work is not None:  # join(): divide by the ranks still training
                self.divisor_work.wait()
                self.divisor = int(self.divisor_work.result()[0].item())
        self.ready[index] = True
        if not self.rebuilt:
            self.ready_order.append(index)
        self._copy_into_bucket(index, param)
        if self.timeline is not None:
            self.timeline.record("grad_ready", param=self.names[index], bucket=self.bucket_of[index].index)
        bucket = self.bucket_of[index]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _copy_into_bucket(self, index: int, param: torch.Tensor) -> None:
        bucket, slot, grad = self.bucket_of[index], self.slot_of[index], param.grad
        if grad.is_sparse != bucket.sparse:
            raise RuntimeError(
                f"minidp: parameter {self.names[index]!r} has a {'sparse' if grad.is_sparse else 'dense'} "
                f"gradient, but a {'sparse' if bucket.sparse else 'dense'} one was expected (only "
                "nn.Embedding / nn.EmbeddingBag with sparse=True produce sparse gradients)")
        if bucket.sparse:
            if not self.custom_hook:
                grad.div_(self.divisor)  # DDP's numerics for sparse gradients: divide in place
            bucket.buffer = grad  # reduced in place, or copied back from the hook's result
            return
        view = bucket.views[slot]
        aliased = grad.data_ptr() == view.data_ptr()
        if not aliased and not self.custom_hook and grad.numel() < SMALL_GRAD_NUMEL:
            # Many small gradients: copying each one costs a Python-issued op; copy them in one
            # batch when the bucket is complete (same products, so the same bits).
            bucket.deferred.append((slot, grad, param))
            return
        if not self.custom_hook:
            # DDP's numerics: scale while copying (multiply by the reciprocal), or divide in place
            # when the gradient already lives in the bucket.
            if aliased:
                view.div_(self.divisor)
            else:
                torch.mul(grad, 1.0 / self.divisor, out=view)
        elif not aliased:
            view.copy_(grad)
        if self.as_view and not aliased:
            param.grad = view

    def _copy_deferred(self, bucket: Bucket) -> None:
        """Copy the bucket's deferred small gradients in, scaled by 1/divisor, in two batched ops."""
        if not bucket.deferred:
            return
        views = [bucket.views[slot] for slot, _, _ in bucket.deferred]
        torch._foreach_copy_(views, [grad for _, grad, _ in bucket.deferred])
        torch._foreach_mul_(views, 1.0 / self.divisor)
        if self.as_view:
            for view, (_, _, param) in zip(views, bucket.deferred):
                param.grad = view
        bucket.deferred = []

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets strictly in index order: every rank issues the same sequence."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            bucket = self.buckets[self.next_bucket]
            params = [self.params[i] for i in bucket.param_indices]
            grad_bucket = GradBucket(bucket.index, bucket.buffer, params, bucket.offsets,
                                     is_last=bucket.index == len(self.buckets) - 1)
            self._copy_deferred(bucket)
            if self.debug and bucket.index == 0:
                debug_mode.check(debug_mode.BACKWARD, self.iteration, self.plan(), self.group,
                                  self.device, 0, self.describe_bucket)
            if self.timeline is not None:
                self.timeline.record("launch", bucket=bucket.index)
            bucket.future = self.comm_hook(self.comm_state, grad_bucket)  # ranks meet here (async)
            if self.timeline is not None:
                self.timeline.watch(bucket.future, bucket=bucket.index)
            self.next_bucket += 1

    def _finalize(self) -> None:
        """End of backward: reduce what is left, agree that every rank succeeded, write gradients back."""
        self.expect_hooks = False
        if self.timeline is not None:
            self.timeline.record("backward_end")
        missing = [i for i, r in enumerate(self.ready) if not r]
        if missing and not self.find_unused:
            # A failed backward like any other: the next forward closes the iteration (prepare_for_forward).
            raise RuntimeError(self._unused_message(missing))
        for i in missing:  # find_unused_parameters: this rank contributes zeros for them
            bucket = self.bucket_of[i]
            if bucket.sparse:
                bucket.buffer = _no_sparse_gradient(self.params[i])
            else:
                bucket.views[self.slot_of[i]].zero_()
            bucket.pending -= 1
        self._launch_ready_buckets()
        results, failed_ranks, used = self._end_iteration(failed=False)
        if failed_ranks:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: the backward of iteration {self.iteration} raised on rank(s) "
                f"{failed_ranks}, so every rank discards this iteration's gradients (none were averaged). "
                "Skip optimizer.step() and call optimizer.zero_grad(), as those ranks do after their own "
                "error, then go on: the ranks stay equal.")
        globally_unused = {i for i, count in enumerate(used) if count == 0} if self.find_unused else set()
        for bucket, result in zip(self.buckets, results):
            self._write_back(bucket, result, globally_unused)
        if self.timeline is not None:
            self.timeline.record("finalize_end")

    def _end_iteration(self, failed: bool):
        """Wait for every bucket, exchange the iteration's status, and close the iteration.

        The status all-reduce holds one flag per rank (did its backward fail?) and, with
        find_unused_parameters, one count per parameter (how many ranks produced its gradient). It
        comes after waiting for the buckets, so that a comm hook's own chained collectives are all
        issued before it, in the same order on every rank.

        Returns:
            (reduced buffers by bucket, failed group ranks, per-parameter use counts or None)
        """
        results = [self._wait(bucket) for bucket in self.buckets]
        status = torch.zeros(self.world_size + len(self.params) * self.find_unused, dtype=torch.int32,
                             device=self.device)
        status[self.rank] = int(failed)
        if self.find_unused:
            status[self.world_size:] = torch.tensor(self.ready, dtype=torch.int32)
        self._all_reduce_status(status)
        counts = status.tolist()
        failed_ranks = [r for r in range(self.world_size) if counts[r]]
        self.reducing = False
        for bucket in self.buckets:
            bucket.future, bucket.deferred = None, []
        if failed_ranks and not self.rebuilt:
            # Every rank drops the failed iteration's ready order, so all rebuild after the same iteration.
            self.ready_order = []
        return results, failed_ranks, counts[self.world_size:] if self.find_unused else None

    def _all_reduce_status(self, status: torch.Tensor) -> None:
        try:
            dist.all_reduce(status, group=self.group)  # ranks meet here: once per synced iteration, last
        except RuntimeError as exc:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: the end-of-backward status "
                f"all-reduce failed; likely {debug_mode.LIKELY_CAUSES}, or a rank's backward raised and it "
                f"ran no forward afterwards (MINIDP_DEBUG=1 checks every step). Cause: {exc}") from exc

    def _wait(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's reduced buffer; a failure names this rank, the iteration and the bucket."""
        try:
            result = bucket.future.wait()
            return result[0] if isinstance(result, list) else result  # DDP accepts [tensor] too
        except RuntimeError as exc:
            raise RuntimeError(
                f"minidp.DDP on rank {self.rank}: iteration {self.iteration}: the all-reduce of bucket "
                f"{bucket.index} [{self.describe_bucket(bucket.index)}] failed; likely "
                f"{debug_mode.LIKELY_CAUSES} (MINIDP_DEBUG=1 checks every step). Cause: {exc}") from exc

    def plan(self) -> list[list[int]]:
        return [b.param_indices for b in self.buckets]

    def describe_bucket(self, index: int) -> str:
        names = [self.names[i] for i in self.buckets[index].param_indices]
        shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
        return f"{len(names)} parameter(s): {', '.join(shown)}"

    def shadow_backward(self) -> None:
        """For a rank that has joined (no more data): match one backward's collectives with zeros."""
        futures = []
        for bucket in self.buckets:  # the same order as the ranks still training launch them
            zeros = _no_sparse_gradient(bucket.buffer) if bucket.sparse else torch.zeros_like(bucket.buffer)
            params = [self.params[i] for i in bucket.param_indices]
            grad_bucket = GradBucket(bucket.index, zeros, params, bucket.offsets,
                                     is_last=bucket.index == len(self.buckets) - 1)
            futures.append(self.comm_hook(self.comm_state, grad_bucket))  # ranks meet here (async)
        for future in futures:
            future.wait()
        # Match the status all-reduce: this rank's backward did not fail, and it used no parameter.
        status = torch.zeros(self.world_size + len(self.params) * self.find_unused, dtype=torch.int32,
                             device=self.device)
        self._all_reduce_status(status)
        if not self.rebuilt and any(status[:self.world_size].tolist()):
            self.ready_order = []  # the iteration failed on a training rank: as in _end_iteration
        elif not self.rebuilt and not self.ready_order:
            self.ready_order = list(range(len(self.params)))  # as DDP: a joined rank votes for the default

    def _fill_with_zeros(self, bucket: Bucket) -> None:
        if bucket.sparse:
            bucket.buffer = _no_sparse_gradient(bucket.buffer)
        else:
            bucket.buffer.zero_()

    def _write_back(self, bucket: Bucket, result: torch.Tensor, skip: set) -> None:
        if bucket.sparse:  # as DDP: the reduced values go into the gradient tensor itself
            i = bucket.param_indices[0]
            grad = self.params[i].grad
            if i in skip:
                return
            if grad is None:  # unused here, used elsewhere (find_unused_parameters)
                self.params[i].grad = result.clone()
            elif result is not grad:
                grad.copy_(result)
            return
        copy_to, copy_from = [], []  # batched into one op below
        for slot, i in enumerate(bucket.param_indices):
            if i in skip:
                continue
            param, view = self.params[i], bucket.views[slot]
            out = view if result is bucket.buffer else result[bucket.offsets[slot]:][:param.numel()].view_as(param)
            if self.as_view:
                if out is not view:
                    copy_to.append(view)
                    copy_from.append(out)
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif param.grad is None:
                param.grad = out.clone()
            else:
                copy_to.append(param.grad)
                copy_from.append(out)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)

    def _unused_message(self, missing: list[int]) -> str:
        names = [self.names[i] for i in missing]
        return (f"minidp.DDP: {len(names)} parameter(s) got no gradient in the last backward: {names}. "
                "Every parameter must take part in the loss each iteration; otherwise pass "
                "find_unused_parameters=True (unused parameters are then reduced as zeros).")


def _no_sparse_gradient(like: torch.Tensor) -> torch.Tensor:
    """An all-zero sparse gradient (nnz=0) shaped like an embedding's: one sparse dimension, as the
    real ones have (gloo's sparse all-reduce requires the same sparse/dense dimensions on all ranks)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=like.device),
                                   torch.empty(0, *like.shape[1:], dtype=like.dtype, device=like.device),
                                   like.shape)


def _check_sparse_backend(params, names, sparse, group) -> None:
    """Sparse all-reduce exists only in gloo (torch's NCCL raises "allreduce_sparse is only available
    in the NCCL experimental branch" during backward): refuse at construction instead."""
    backend = dist.get_backend(group)
    # A group may name a backend per device type, e.g. "cpu:gloo,cuda:nccl".
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    for p, name, is_sparse in zip(params, names, sparse):
        used = per_device.get(p.device.type, backend)
        if is_sparse and used != "gloo":
            raise ValueError(
                f"parameter {name!r} gets sparse gradients (nn.Embedding/EmbeddingBag with sparse=True) on "
                f"{p.device.type}, where the process group's backend is {used!r}: only gloo can all-reduce "
                "sparse tensors. Use sparse=False, or a gloo process group.")
