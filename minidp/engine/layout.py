"""The buckets over training: which bucket and slot each gradient goes to, and when that changes.

torch DDP's layout changes at most once, and minidp's at the same point:
  * at construction: planning.plan_initial (one bucket for the first iteration, unless
    find_unused_parameters);
  * once, after the first synced iteration (torch's `needs_rebuild`): re-planned in the order the
    gradients became ready, rank 0's order broadcast so that every rank builds the same buckets.
(With bucket_cap_mb="auto" the first iterations also try other caps: autocap.py.)
At world size 1 on the default path there are no buffers (`allocate=False`): only the plan is kept.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import planning
from .buckets import Bucket
from .collectives import global_rank
from .sparse import SparseBucket

SMALL_GRAD_NUMEL = 65536  # a dense gradient below this waits and is copied at launch, in one batch


class BucketLayout:
    """The reducer's current buckets, and the one rebuild that replaces them.

    Args:
        params, names: the reducer's parameters and their names.
        sparse: by parameter, whether its gradient is sparse (a bucket of its own).
        bucket_cap_mb: the wrapper's cap in MiB, None (DDP's default) or "auto".
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuild once, in ready order.
        process_group: the group whose rank 0's order is adopted (None: the world).
        allocate: build the buffers (False: world size 1 on the default path, the plan alone).
        as_view: gradient_as_bucket_view (gradients then never wait to be copied at launch).
    """

    def __init__(self, params, names, sparse, *, bucket_cap_mb, needs_rebuild, process_group, allocate, as_view):
        self.params, self.names, self.sparse, self.process_group = params, names, sparse, process_group
        self.allocate, self.as_view, self.needs_rebuild = allocate, as_view, needs_rebuild
        self.world_size, self.device = dist.get_world_size(process_group), params[0].device
        self.rebuild_pending, self.ready_order = needs_rebuild, None  # the order noted by the reducer
        from .autocap import AutoCap  # a feature beside the core
        self.tuner = AutoCap() if bucket_cap_mb == "auto" else None
        self.cap = self.tuner.cap if self.tuner else bucket_cap_mb  # the cap in use
        # The one place that decides: small dense gradients wait, and are copied at launch in a batch.
        self.copy_later = [p.numel() < SMALL_GRAD_NUMEL and not is_sparse and not as_view
                           for p, is_sparse in zip(params, sparse)]
        limits = planning.bucket_limits(self.cap, first_iteration=True, needs_rebuild=needs_rebuild)
        self.adopt(planning.plan_initial(*self._sizes_and_keys(), limits, sparse))

    def _sizes_and_keys(self):
        return [p.numel() * p.element_size() for p in self.params], [(p.dtype, p.device) for p in self.params]

    def adopt(self, plan: list[list[int]]) -> None:
        """Make `plan` (parameter indices per bucket, in launch order) the layout, with fresh buffers."""
        self.plan = [list(indices) for indices in plan]
        kinds = [SparseBucket if self.sparse[indices[0]] else Bucket for indices in plan]
        self.buckets = [kind(b, indices, self.params) for b, (kind, indices) in enumerate(zip(kinds, plan))] \
            if self.allocate else []
        n = len(self.params)
        self.bucket_of, self.slot_of = [None] * n, [0] * n  # bucket_of None: reduced locally
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i], self.slot_of[i] = bucket, slot
                grad = self.params[i].grad
                if self.as_view and grad is not None and not bucket.sparse:
                    bucket.views[slot].copy_(grad)  # adopt the existing gradient, as DDP does
                    self.params[i].grad = bucket.views[slot]

    def allocate_buffers(self) -> None:
        """From now on with buffers (a comm hook registered at world size 1 sees every bucket, as in DDP)."""
        self.allocate = True
        self.adopt(self.plan)

    def note_ready_order(self, order) -> None:
        """The order gradients became ready in a step that succeeded on every rank (kept if a rebuild waits)."""
        if self.rebuild_pending and order is not None:
            self.ready_order = list(order)

    def maybe_replan(self, completed: int) -> bool:
        """Before a forward: rebuild in ready order once, after the first synced iteration noted one.

        Args:
            completed: synced iterations completed on every rank (bucket_cap_mb="auto" times by it).
        Returns:
            Whether the buckets were rebuilt now.
        """
        rebuilt = bool(self.rebuild_pending and self.ready_order)
        if rebuilt:
            if len(self.ready_order) != len(self.params):
                raise RuntimeError(f"minidp: cannot rebuild buckets: {len(self.ready_order)} of "
                                   f"{len(self.params)} gradients were recorded in the first iteration")
            order = torch.tensor(self.ready_order, dtype=torch.int64, device=self.device)
            if self.world_size > 1:  # ranks meet here: all adopt rank 0's order, so their layouts agree
                dist.broadcast(order, src=global_rank(self.process_group, 0), group=self.process_group)
            self.rebuilt_order, self.rebuild_pending, self.ready_order = order.tolist(), False, None
            self.adopt(self.plan_for(self.cap))
        if self.tuner is not None and not self.rebuild_pending:
            self.tuner.retune(self, completed)  # bucket_cap_mb="auto": ranks meet there when it decides
        return rebuilt

    def plan_for(self, bucket_cap_mb) -> list[list[int]]:
        """The layout torch DDP would use with `bucket_cap_mb` from now on (after its first iteration)."""
        sizes, keys = self._sizes_and_keys()
        if self.needs_rebuild:
            limits = planning.bucket_limits(bucket_cap_mb, first_iteration=False, needs_rebuild=True)
            return planning.plan_rebuilt(sizes, keys, limits, self.rebuilt_order, self.sparse)
        limits = planning.bucket_limits(bucket_cap_mb, first_iteration=True, needs_rebuild=False)
        return planning.plan_initial(sizes, keys, limits, self.sparse)
