"""The buckets over training: which bucket and slot each gradient goes to, and when that changes.

As in torch DDP: planned at construction (one bucket for the first iteration, unless
find_unused_parameters), then rebuilt once after the first synced iteration, in the order gradients
became ready, rank 0's order broadcast so every rank builds the same buckets. The mode
(arguments.choose) gives the bucket kind. The options that change the layout live here, after it:
the limits of bucket_cap_mb_list (`limits_of`) and bucket_cap_mb="auto"'s tuner (`AutoCap`).
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ..validate import check_number
from . import planning
from .collectives import global_rank
from .planning import MIB

SMALL_GRAD_NUMEL = 65536  # a dense gradient below this waits and is copied at launch, in one batch


class BucketLayout:
    """The reducer's current buckets, and the one rebuild that replaces them.

    Args:
        params, names: the reducer's parameters and their names.
        mode: arguments.choose's Mode: sparse (by parameter), new_bucket (the bucket kinds),
            needs_rebuild (rebuild once, in ready order), cap (MiB; None: default), limits (the
            planner's, or `limits_of` a bucket_cap_mb_list), tuner (an AutoCap, or None).
        process_group: the group whose rank 0's order is adopted (None: the world).
        allocate: build buffers (False at world size 1 on the default path: the plan alone).
    """

    def __init__(self, params, names, mode, *, process_group, allocate):
        self.params = params
        self.names = names
        self.sparse = mode.sparse  # by parameter: a sparse gradient has a bucket of its own
        self.process_group = process_group
        self.allocate = allocate
        self.new_bucket = mode.new_bucket  # the bucket kind: buckets.py or bucket_kinds.py
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
        self.planned_bucket = [0] * len(self.params)  # by parameter: its bucket in the plan
        for b, ids in enumerate(self.plan):
            for i in ids:
                self.planned_bucket[i] = b
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

    def note_ready_order(self, order, only_if_none: bool = False) -> None:
        """The ready order of a step that succeeded on every rank (kept while a rebuild waits);
        `only_if_none`: unless one is noted already (a joined rank's default, join.py)."""
        if self.rebuild_pending and order is not None and not (only_if_none and self.ready_order):
            self.ready_order = list(order)

    def may_change(self) -> bool:
        """Whether the buckets may change: a rebuild to come, or bucket_cap_mb="auto" tuning."""
        return self.rebuild_pending or (self.tuner is not None and self.tuner.chosen is None)

    def rebuild_once(self) -> None:
        """From now on, rebuild once in ready order (static_graph set after construction)."""
        self.needs_rebuild = self.rebuild_pending = True

    def has_rebuilt(self) -> bool:
        """Whether the buckets were rebuilt in ready order (torch DDP's _has_rebuilt_buckets)."""
        return bool(self.needs_rebuild and not self.rebuild_pending)

    def first_plan(self) -> list[list[int]]:
        """The plan of the first iteration with the cap in use (what torch's logger reports)."""
        return self.plan_with_cap(self.cap, first_iteration=True)

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


# bucket_cap_mb_list (torch DDP >= 2.14's _BucketCapacityConfig, Reducer::rebuild_buckets): the
# list is the byte limits, in MiB times 2**20 rounded down, for the plan made at construction *and*
# the rebuilt one (so the first iteration is bucketed too); bucket_cap_mb is then ignored, the cap
# torch reports is the list's largest, and an empty list means no list (torch tests its truth).

def check_cap_list(value, bucket_cap_mb) -> list | None:
    """The list as given (None for None or empty), else TypeError/ValueError naming the value."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"bucket_cap_mb_list={value!r} must be a list of bucket caps in MiB, "
                        "or None")
    if not value:
        return None  # torch DDP: `if bucket_cap_mb_list:`, so [] is the default
    for cap in value:
        check_number("bucket_cap_mb_list's element", cap, low=0)
        if not math.isfinite(cap):
            raise ValueError(f"bucket_cap_mb_list={value!r}: every cap must be finite (MiB)")
    if bucket_cap_mb == "auto":
        raise ValueError(f"bucket_cap_mb=\"auto\" and bucket_cap_mb_list={value!r} cannot be used "
                         "together: the list fixes the caps; pass one of them")
    return list(value)


def limits_of(caps_mb: list, cap, first_iteration: bool, needs_rebuild: bool) -> list[int]:
    """planning.bucket_limits' signature: the list's bytes for every plan, whatever the rest."""
    return [int(mb * MIB) for mb in caps_mb]


# bucket_cap_mb="auto": time a few caps in the first iterations, keep rank 0's fastest. Before each
# forward that may sync, maybe_replan calls AutoCap.retune, which switches the layout's cap.

CANDIDATE_CAPS_MB = (1, 5, 25, 100)
STEPS = 5  # timed steps per visit of a candidate (after one untimed step)
ROUNDS = 2  # visits per candidate: in order, then in reverse (drift of the machine hits all alike)


class AutoCap:
    """bucket_cap_mb="auto": time a few bucket caps during the first iterations, keep the fastest.

    Which cap is fastest depends on the model, the batch, the machine and the network: small buckets
    start communicating early (more overlap with backward) but pay a fixed cost per collective;
    large ones pay it rarely but start late. Horovod's autotune measures its fusion buffer size the
    same way; torch DDP has no such thing (its default, 25 MiB with a 1 MiB first bucket, is one of
    the candidates here in spirit: 1 and 25 are both tried).

    How, as the layout runs it (BucketLayout.maybe_replan -> retune, before each forward that may
    sync):
      * the first iteration runs as torch DDP's does (one bucket, or the construction layout with
        find_unused_parameters); from the next forward on, each candidate cap in turn lays out the
        buckets (`layout.plan_with_cap(cap)`: the layout torch DDP would use with that cap) for one
        untimed step (fresh buffers) and STEPS timed ones; ROUNDS rounds, the second in reverse
        order (A B C C B A),
        and each candidate's median over all its timed steps counts;
      * candidates whose layout equals an earlier candidate's are skipped (the same buckets run
        the same);
      * a step is the time between two forwards that follow completed synced iterations, so it holds
        forward, backward, the communication left at its end, and the optimizer step;
      * when every candidate has been timed, each rank takes rank 0's fastest (a broadcast: one
        decision, so every rank's buckets stay the same), and the layout stays for the rest of
        training.
    Every rank switches at the same completed-iteration count (failed iterations do not count, on
    any rank), so the ranks' layouts change together. Rank 0's clock decides; the broadcast is the
    layout's.

    Args:
        candidates: bucket caps to try, in MiB. Default None: CANDIDATE_CAPS_MB (read when built).
        steps: timed steps per candidate. Default None: STEPS.
    """

    def __init__(self, candidates=None, steps: int | None = None):
        self.candidates = list(CANDIDATE_CAPS_MB if candidates is None else candidates)
        self.steps = STEPS if steps is None else steps
        self.index = 0             # the candidate being timed
        self._schedule, self._visit = [], 0  # candidate indices to visit in turn, and where we are
        self.chosen = None         # the cap adopted for good (None while tuning)
        self.step_times = {}       # cap -> this rank's timed step seconds
        self._stamps = []          # clock readings at this candidate's step boundaries
        self._seen = None          # the reducer's completed count at the last call
        self._distinct = None      # candidates left after dropping repeated layouts

    @property
    def cap(self) -> float:
        """The cap in use now: the candidate being timed, or the chosen one."""
        return self.chosen if self.chosen is not None else self.candidates[self.index]

    def step(self, completed: int, plan_for) -> float | None:
        """Called before every forward that may sync: the cap to use from this forward on, or None
        once every candidate has been timed (the caller then adopts rank 0's `fastest()`).

        Args:
            completed: iterations completed on every rank so far (the reducer's count).
            plan_for: cap -> bucket layout (to skip candidates that lay out the same buckets).
        """
        if self.chosen is not None or completed == self._seen:
            return self.cap  # decided, or no iteration finished since the last call (no_sync, eval)
        self._seen = completed
        if self._distinct is None:
            self._start(plan_for)
            if len(self._distinct) == 1:
                return None  # every candidate lays out the same buckets: nothing to time
        self._stamps.append(time.perf_counter())
        if len(self._stamps) < self.steps + 2:  # one untimed step, then `steps` timed ones
            return self.cap
        times = [b - a for a, b in zip(self._stamps[1:], self._stamps[2:])]
        self.step_times.setdefault(self.cap, []).extend(times)
        self._visit += 1
        if self._visit == len(self._schedule):
            return None
        self.index = self._schedule[self._visit]
        self._stamps = [time.perf_counter()]
        return self.cap

    def medians(self) -> dict:
        """This rank's median step seconds per timed cap."""
        return {cap: sorted(t)[len(t) // 2] for cap, t in self.step_times.items()}

    def _start(self, plan_for) -> None:
        plans, self._distinct = [], []
        for i, cap in enumerate(self.candidates):
            plan = plan_for(cap)
            if plan not in plans:
                plans.append(plan)
                self._distinct.append(i)
        rounds = [self._distinct[::-1] if r % 2 else self._distinct for r in range(ROUNDS)]
        self._schedule = [i for visits in rounds for i in visits]
        self.index = self._schedule[0]

    def fastest(self) -> int:
        """The index (into candidates) of the cap with this rank's shortest median step."""
        medians = self.medians()
        if not medians:  # a single distinct layout
            return self._distinct[0]
        return self.candidates.index(min(medians, key=medians.get))

    def retune(self, layout, completed: int) -> None:
        """Before a forward: step the timing; switch the layout's cap, or adopt rank 0's fastest.

        Args:
            layout: the reducer's BucketLayout (through its public methods: plan_with_cap, use_cap).
            completed: synced iterations completed on every rank (the clock ticks by it).
        """
        cap = self.step(completed, layout.plan_with_cap)
        if cap is None:  # every candidate timed
            best = torch.tensor([self.fastest()], dtype=torch.int64, device=layout.device)
            if layout.world_size > 1:  # ranks meet here: every rank adopts rank 0's choice
                group = layout.process_group
                dist.broadcast(best, src=global_rank(group, 0), group=group)
            cap = self.chosen = self.candidates[int(best.item())]
        layout.use_cap(cap)  # fresh buckets if the cap changed
