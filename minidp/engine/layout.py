"""The buckets over training: which bucket and slot each gradient goes to, and when that changes.

As in torch DDP: planned at construction (one bucket for the first iteration, unless
find_unused_parameters), then rebuilt once after the first synced iteration, in the order gradients
became ready, rank 0's order broadcast so every rank builds the same buckets. (bucket_cap_mb="auto"
tries other caps in the first iterations: autocap.py.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import planning
from .buckets import Bucket
from .collectives import global_rank
from .grad_views import ViewBucket
from .sparse import SparseBucket

SMALL_GRAD_NUMEL = 65536  # a dense gradient below this waits and is copied at launch, in one batch


class BucketLayout:
    """The reducer's current buckets, and the one rebuild that replaces them.

    Args:
        params, names, sparse: the reducer's parameters, names, and whether each gradient is sparse.
        bucket_cap_mb: the wrapper's cap in MiB, None (DDP's default) or "auto".
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuild once, in ready order.
        process_group: the group whose rank 0's order is adopted (None: the world).
        allocate: build buffers (False at world size 1 on the default path: the plan alone).
        as_view: gradient_as_bucket_view (the buckets' views are the `.grad`s: grad_views.py).
    """

    def __init__(self, params, names, sparse, *, bucket_cap_mb, needs_rebuild, process_group, allocate, as_view):
        self.params, self.names, self.sparse, self.process_group = params, names, sparse, process_group
        self.allocate, self.as_view, self.needs_rebuild = allocate, as_view, needs_rebuild
        self.world_size, self.device = dist.get_world_size(process_group), params[0].device
        self.rebuild_pending, self.ready_order = needs_rebuild, None  # the order noted by the reducer
        from .autocap import AutoCap  # a feature beside the core
        self.tuner = AutoCap() if bucket_cap_mb == "auto" else None
        self.cap = self.tuner.cap if self.tuner else bucket_cap_mb  # the cap in use
        # The one place that decides: small dense gradients wait for launch, then one batch (views too).
        self.copy_later = [not is_sparse and p.numel() < SMALL_GRAD_NUMEL for p, is_sparse in zip(params, sparse)]
        limits = planning.bucket_limits(self.cap, first_iteration=True, needs_rebuild=needs_rebuild)
        self.adopt(planning.plan_initial(*self._sizes_and_keys(), limits, sparse))

    def _sizes_and_keys(self):
        return [p.numel() * p.element_size() for p in self.params], [(p.dtype, p.device) for p in self.params]

    def adopt(self, plan: list[list[int]]) -> None:
        """Make `plan` (parameter indices per bucket, in launch order) the layout, with fresh buffers."""
        self.plan = [list(indices) for indices in plan]
        dense = ViewBucket if self.as_view else Bucket  # the bucket kinds: grad_views.py, sparse.py
        kinds = [SparseBucket if self.sparse[ids[0]] else dense for ids in plan] if self.allocate else []
        self.buckets = [kind(b, ids, self.params) for b, (kind, ids) in enumerate(zip(kinds, plan))]
        n = len(self.params)
        self.bucket_of, self.slot_of = [None] * n, [0] * n  # bucket_of None: reduced locally
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i], self.slot_of[i] = bucket, slot

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
            limits = planning.bucket_limits(self.cap, first_iteration=False, needs_rebuild=True)
            self.adopt(planning.plan_rebuilt(*self._sizes_and_keys(), limits, self.rebuilt_order, self.sparse))
        if self.tuner is not None and not self.rebuild_pending:
            self.tuner.retune(self, completed)  # bucket_cap_mb="auto": ranks meet there when it decides
        return rebuilt
