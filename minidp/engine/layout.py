"""The buckets over training: which bucket and slot each gradient goes to, and when that changes.

As in torch DDP: planned at construction (one bucket for the first iteration, unless
find_unused_parameters), then rebuilt once after the first synced iteration, in the order gradients
became ready, rank 0's order broadcast so every rank builds the same buckets. The mode (modes.py)
gives the bucket kind and, for bucket_cap_mb="auto", a tuner that changes the cap (autocap.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import planning
from .collectives import global_rank

SMALL_GRAD_NUMEL = 65536  # a dense gradient below this waits and is copied at launch, in one batch


class BucketLayout:
    """The reducer's current buckets, and the one rebuild that replaces them.

    Args:
        params, names: the reducer's parameters and their names.
        mode: modes.choose's Mode: sparse (by parameter), new_bucket (the bucket kinds),
            needs_rebuild (rebuild once, in ready order), cap (MiB; None: default), limits, tuner.
        process_group: the group whose rank 0's order is adopted (None: the world).
        allocate: build buffers (False at world size 1 on the default path: the plan alone).
    """

    def __init__(self, params, names, mode, *, process_group, allocate):
        self.params = params
        self.names = names
        self.sparse = mode.sparse  # by parameter: a sparse gradient has a bucket of its own
        self.process_group = process_group
        self.allocate = allocate
        self.new_bucket = mode.new_bucket  # the bucket kind: buckets.py, grad_views.py, sparse.py
        self.needs_rebuild = mode.needs_rebuild
        self.cap, self.limits = mode.cap, mode.limits  # the cap in use (use_cap), its limits
        self.tuner = mode.tuner  # bucket_cap_mb="auto": calls use_cap in the first iterations
        self.world_size = dist.get_world_size(process_group)
        self.device = params[0].device
        self.rebuild_pending = mode.needs_rebuild
        self.ready_order = None  # the order noted by the reducer
        # The one place that decides: small dense gradients wait for the launch, then one batch.
        self.copy_later = [not is_sparse and p.numel() < SMALL_GRAD_NUMEL
                           for p, is_sparse in zip(params, self.sparse)]
        self.adopt(self.plan_with_cap(self.cap, first_iteration=True))

    def plan_with_cap(self, cap, first_iteration: bool = False) -> list[list[int]]:
        """The plan torch DDP would use with bucket_cap_mb=`cap` in the first iteration or later
        ones: in registration order until the rebuild, then in rank 0's ready order."""
        sizes = [p.numel() * p.element_size() for p in self.params]
        keys = [(p.dtype, p.device) for p in self.params]
        limits = self.limits(cap, first_iteration, self.needs_rebuild)
        if first_iteration or not self.needs_rebuild:
            return planning.plan_initial(sizes, keys, limits, self.sparse)
        return planning.plan_rebuilt(sizes, keys, limits, self.rebuilt_order, self.sparse)

    def adopt(self, plan: list[list[int]]) -> None:
        """Make `plan` (parameter indices by bucket, in launch order) the layout; fresh buffers."""
        self.plan = [list(indices) for indices in plan]
        self.buckets = []
        if self.allocate:  # False at world size 1 on the default path: no buckets
            for b, ids in enumerate(self.plan):
                self.buckets.append(self.new_bucket(b, ids, self.params, self.sparse[ids[0]]))
        self.bucket_of = [None] * len(self.params)  # None: reduced locally
        self.slot_of = [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i] = bucket
                self.slot_of[i] = slot

    def allocate_buffers(self) -> None:
        """Buffers from now on, also at world size 1 (a comm hook sees every bucket, as in DDP)."""
        if not self.allocate:
            self.allocate = True
            self.adopt(self.plan)

    def use_cap(self, cap) -> None:
        """Plan with `cap` from now on (fresh buffers), unless it is the cap in use already."""
        if cap != self.cap:
            self.cap = cap
            self.adopt(self.plan_with_cap(cap))

    def note_ready_order(self, order) -> None:
        """The ready order of a step that succeeded on every rank (kept while a rebuild waits)."""
        if self.rebuild_pending and order is not None:
            self.ready_order = list(order)

    def maybe_replan(self, completed: int) -> bool:
        """Before a forward: rebuild in ready order once, after the first synced step noted one.

        Args:
            completed: synced iterations completed on every rank (bucket_cap_mb="auto" times by it).
        Returns:
            Whether the buckets were rebuilt now.
        """
        rebuilt = bool(self.rebuild_pending and self.ready_order)
        if rebuilt:
            if len(self.ready_order) != len(self.params):
                raise RuntimeError(f"minidp: cannot rebuild buckets: {len(self.ready_order)} of "
                                   f"{len(self.params)} gradients were recorded in the first "
                                   "iteration")
            order = torch.tensor(self.ready_order, dtype=torch.int64, device=self.device)
            if self.world_size > 1:  # ranks meet here: all adopt rank 0's order, so layouts agree
                root = global_rank(self.process_group, 0)
                dist.broadcast(order, src=root, group=self.process_group)
            self.rebuilt_order = order.tolist()
            self.rebuild_pending = False
            self.ready_order = None
            self.adopt(self.plan_with_cap(self.cap))
        if self.tuner is not None and not self.rebuild_pending:
            self.tuner.retune(self, completed)  # bucket_cap_mb="auto": ranks meet there to decide
        return rebuilt
