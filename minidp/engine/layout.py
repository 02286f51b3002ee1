"""The bucket layout over training: which bucket and slot each gradient goes to, and when that changes.

torch DDP's layout changes at most twice, and minidp's at the same points:
  * at construction: planning.plan_initial (one bucket for the first iteration, unless
    find_unused_parameters);
  * once, after the first synced iteration (when torch's `needs_rebuild`): re-planned in the order
    the gradients became ready, rank 0's order broadcast so every rank builds the same buckets;
  * with bucket_cap_mb="auto": in the first iterations, each candidate cap in turn (planning.AutoCap),
    then rank 0's fastest, broadcast.
Each adopted plan gets fresh buffers (buckets.build_buckets), unless gradients are reduced locally
(world size 1 on the default path), where only the plan is kept (the timeline and debug mode read it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import planning
from .buckets import build_buckets
from .collectives import global_rank


class BucketLayout:
    """The reducer's current buckets, and the re-planning that replaces them.

    Args:
        params, names: the reducer's parameters and their names.
        sparse: by parameter, whether its gradient is sparse (a bucket of its own).
        bucket_cap_mb: the wrapper's cap in MiB, None (DDP's default) or "auto".
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuild once, in ready order.
        process_group: the group whose rank 0 decides re-plans (None: the world).
        allocate: build the buffers (False: world size 1 on the default path, the plan alone).
        gradient_as_bucket_view: a gradient that exists when a plan is adopted moves into its bucket.
    """

    def __init__(self, params, names, sparse, *, bucket_cap_mb, needs_rebuild, process_group, allocate,
                 gradient_as_bucket_view):
        self.params, self.names, self.sparse, self.process_group = params, names, sparse, process_group
        self.allocate, self.gradient_as_bucket_view = allocate, gradient_as_bucket_view
        self.world_size, self.device = dist.get_world_size(process_group), params[0].device
        self.needs_rebuild = needs_rebuild
        self.rebuild_pending, self.ready_order = needs_rebuild, []  # ready_order: filled by the reducer
        self.tuner = planning.AutoCap() if bucket_cap_mb == "auto" else None
        self.cap = self.tuner.cap if self.tuner else bucket_cap_mb  # the cap in use
        limits = planning.bucket_limits(self.cap, first_iteration=True, needs_rebuild=needs_rebuild)
        self.adopt(planning.plan_initial(*self._sizes_and_keys(), limits, sparse))

    def _sizes_and_keys(self):
        return [p.numel() * p.element_size() for p in self.params], [(p.dtype, p.device) for p in self.params]

    def adopt(self, plan: list[list[int]]) -> None:
        """Make `plan` (parameter indices per bucket, in launch order) the layout, with its buffers."""
        self.plan = [list(indices) for indices in plan]
        self.bucket_index_of = [0] * len(self.params)  # for the timeline's "grad_ready"
        for b, indices in enumerate(self.plan):
            for i in indices:
                self.bucket_index_of[i] = b
        self.buckets = build_buckets(plan, self.params, self.sparse) if self.allocate else []
        self.bucket_of, self.slot_of = [None] * len(self.params), [0] * len(self.params)
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.bucket_of[i], self.slot_of[i] = bucket, slot
                grad = self.params[i].grad
                if self.gradient_as_bucket_view and grad is not None and not bucket.sparse:
                    bucket.views[slot].copy_(grad)  # adopt the existing gradient, as DDP does
                    self.params[i].grad = bucket.views[slot]

    def allocate_buffers(self) -> None:
        """From now on with buffers (a comm hook registered at world size 1 sees every bucket, as in DDP)."""
        self.allocate = True
        self.adopt(self.plan)

    def by_name(self) -> list[list[str]]:
        """The current layout by parameter name, in launch order (for reading and tests)."""
        return [[self.names[i] for i in indices] for indices in self.plan]

    def describe(self, index: int) -> str:
        names = [self.names[i] for i in self.plan[index]]
        shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
        return f"{len(names)} parameter(s): {', '.join(shown)}"

    def maybe_replan(self, completed: int) -> bool:
        """Before a forward: rebuild after the first synced iteration (once), step the cap tuner.

        Args:
            completed: synced iterations completed on every rank (the tuner times by it).
        Returns:
            Whether the buckets were rebuilt in ready order now.
        """
        rebuilt = self.rebuild_pending and bool(self.ready_order)
        if rebuilt:
            if len(self.ready_order) != len(self.params):
                raise RuntimeError(f"minidp: cannot rebuild buckets: {len(self.ready_order)} of "
                                   f"{len(self.params)} gradients were recorded in the first iteration")
            order = torch.tensor(self.ready_order, dtype=torch.int64, device=self.device)
            if self.world_size > 1:  # ranks meet here: all ranks adopt rank 0's order, so their layouts agree
                dist.broadcast(order, src=global_rank(self.process_group, 0), group=self.process_group)
            self.rebuilt_order, self.rebuild_pending, self.ready_order = order.tolist(), False, []
            self.adopt(self.plan_for(self.cap))
        if self.tuner is not None and not self.rebuild_pending:
            self._tune(completed)
        return rebuilt

    def plan_for(self, bucket_cap_mb) -> list[list[int]]:
        """The layout torch DDP would use with `bucket_cap_mb` from now on (after its first iteration)."""
        sizes, keys = self._sizes_and_keys()
        if self.needs_rebuild:
            limits = planning.bucket_limits(bucket_cap_mb, first_iteration=False, needs_rebuild=True)
            return planning.plan_rebuilt(sizes, keys, limits, self.rebuilt_order, self.sparse)
        limits = planning.bucket_limits(bucket_cap_mb, first_iteration=True, needs_rebuild=False)
        return planning.plan_initial(sizes, keys, limits, self.sparse)

    def _tune(self, completed: int) -> None:
        """bucket_cap_mb="auto": time the candidate caps in turn, then adopt rank 0's fastest (planning.AutoCap)."""
        cap = self.tuner.step(completed, self.plan_for)
        if cap is None:  # every candidate timed
            best = torch.tensor([self.tuner.fastest()], dtype=torch.int64, device=self.device)
            if self.world_size > 1:  # ranks meet here: every rank adopts rank 0's choice
                dist.broadcast(best, src=global_rank(self.process_group, 0), group=self.process_group)
            cap = self.tuner.chosen = self.tuner.candidates[int(best.item())]
        if cap != self.cap:
            self.cap = cap
            self.adopt(self.plan_for(cap))
