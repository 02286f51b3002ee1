"""Bucket layout: which parameters share one flat all-reduce buffer. No process group, no tensor.

The rules reproduce torch DDP's, so that a bucket holds the same gradients at the same offsets as
DDP's does (that is what bitwise equality at 3+ ranks needs, since gloo's ring sums an element in
an order that depends on where it sits in the buffer):

  * walk the parameters in the given order; group them by (dtype, device); each group fills a
    bucket until its byte size reaches the current limit (>=, so a bucket may pass the limit by
    one tensor), then starts a new one and moves on to the next limit of the list (staying on the
    last limit);
  * a parameter with a sparse gradient gets a bucket of its own, added when it is walked (sparse
    tensors cannot share a flat buffer); it takes no part in the size limits;
  * leftover partial buckets are added at the end;
  * at construction the order is registration order, the buckets are sorted by their smallest
    index and the list is reversed (the last-defined parameters' gradients arrive first); inside a
    bucket the parameters stay in registration order;
  * after the first iteration the order is the order gradients became ready, and nothing is
    sorted or reversed.

With bucket_cap_mb="auto", `AutoCap` picks the cap (see its docstring).

The buffers a plan becomes, and how gradients go in and out of them, are in buckets.py.
"""
from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
UNBOUNDED = sys.maxsize


def bucket_limits(bucket_cap_mb: float | None, first_iteration: bool, needs_rebuild: bool) -> list[int]:
    """The list of byte limits DDP walks for one plan.

    Args:
        bucket_cap_mb: the user's cap in MiB; None means DDP's default (25 MiB, with a 1 MiB
            first bucket).
        first_iteration: True for the plan made at construction, False for the rebuilt one.
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: the buckets are
            rebuilt in gradient-ready order after the first iteration.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first_cap = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    if first_iteration and needs_rebuild:
        # The real backward order is unknown yet: reduce everything at the end, in one bucket.
        return [UNBOUNDED]
    return [first_cap, cap] if first_cap < cap else [cap]


def assign_buckets(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                   order: Sequence[int] | None = None, sparse: Sequence[bool] = ()) -> list[list[int]]:
    """Cut tensors into buckets by byte size; DDP's compute_bucket_assignment_by_size.

    Args:
        sizes: byte size of each tensor (numel * element_size), by tensor index.
        keys: a group key per tensor index, e.g. (dtype, device); groups never share a bucket.
        limits: byte limits, used in turn per group; the last one repeats.
        order: tensor indices in the order to walk them. Default: 0, 1, 2, ... in which case the
            buckets are sorted by their smallest index, as DDP does.
        sparse: by tensor index, whether its gradient is sparse (each gets a bucket of its own).
            Default: none.

    Returns:
        A list of buckets, each a list of tensor indices in the order walked.
    """
    if not limits or any(limit < 0 for limit in limits):  # 0: every tensor closes its bucket
        raise ValueError(f"limits={list(limits)} must be a non-empty list of byte sizes >= 0")
    walk = range(len(sizes)) if order is None else order
    open_buckets: OrderedDict = OrderedDict()  # key -> [indices, bytes]; first-seen key first
    limit_pos: dict = {}
    result = []
    for index in walk:
        if sparse and sparse[index]:
            result.append([index])
            continue
        key = keys[index]
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += sizes[index]
        pos = limit_pos.setdefault(key, 0)
        if bucket[1] >= limits[pos]:
            result.append(bucket[0])
            open_buckets[key] = [[], 0]
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    if order is None:
        result.sort(key=min)
    return result


def plan_initial(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The construction-time plan: registration order, buckets reversed (last layers first)."""
    return list(reversed(assign_buckets(sizes, keys, limits, sparse=sparse)))


def plan_rebuilt(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 ready_order: Sequence[int], sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The plan after the first iteration: the order in which gradients became ready."""
    if sorted(ready_order) != list(range(len(sizes))):
        raise ValueError(f"ready_order={list(ready_order)} must be a permutation of 0..{len(sizes) - 1}")
    return assign_buckets(sizes, keys, limits, order=ready_order, sparse=sparse)


# ---- bucket_cap_mb="auto" -------------------------------------------------------------------------

CANDIDATE_CAPS_MB = (1, 5, 25, 100)
STEPS = 5  # timed steps per visit of a candidate (after one untimed step)
ROUNDS = 2  # visits per candidate: in order, then in reverse (drift of the machine hits all alike)


class AutoCap:
    """bucket_cap_mb="auto": time a few bucket caps during the first iterations, keep the fastest.

    Which cap is fastest depends on the model, the batch, the machine and the network: small buckets
    start communicating early (more overlap with backward) but pay a fixed cost per collective; large
    ones pay it rarely but start late. Horovod's autotune measures its fusion buffer size the same way;
    torch DDP has no such thing (its default, 25 MiB with a 1 MiB first bucket, is one of the candidates
    here in spirit: 1 and 25 are both tried).

    How, as the layout runs it (layout.BucketLayout.maybe_replan, before each forward that may sync):
      * the first iteration runs as torch DDP's does (one bucket, or the construction layout with
        find_unused_parameters); from the next forward on, each candidate cap in turn lays out the
        buckets (`plan_for(cap)`: the layout torch DDP would use with that cap) for one untimed step
        (fresh buffers) and STEPS timed ones; ROUNDS rounds, the second in reverse order (A B C C B A),
        and each candidate's median over all its timed steps counts;
      * candidates whose layout equals an earlier candidate's are skipped (the same buckets run the same);
      * a step is the time between two forwards that follow completed synced iterations, so it holds
        forward, backward, the communication left at its end, and the optimizer step;
      * when every candidate has been timed, each rank takes rank 0's fastest (a broadcast: one
        decision, so every rank's buckets stay the same), and the layout stays for the rest of training.
    Every rank switches at the same completed-iteration count (failed iterations do not count, on any
    rank), so the ranks' layouts change together. Rank 0's clock decides; the broadcast is the layout's.

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
        self.step_times.setdefault(self.cap, []).extend(b - a for a, b in zip(self._stamps[1:], self._stamps[2:]))
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
        self._schedule = [i for r in range(ROUNDS) for i in (self._distinct[::-1] if r % 2 else self._distinct)]
        self.index = self._schedule[0]

    def fastest(self) -> int:
        """The index (into candidates) of the cap with this rank's shortest median step."""
        medians = self.medians()
        if not medians:  # a single distinct layout
            return self._distinct[0]
        return self.candidates.index(min(medians, key=medians.get))
