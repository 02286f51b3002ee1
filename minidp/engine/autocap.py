"""bucket_cap_mb="auto": time a few bucket caps during the first iterations, keep rank 0's fastest.

A feature beside the core: modes.py makes one for the layout (layout.py), which calls
`AutoCap.retune` before each forward that may sync; retune switches the layout's cap through its
public methods (`plan_with_cap`, `use_cap`). Nothing else in the engine knows about it.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .collectives import global_rank

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

    How, as the layout runs it (layout.BucketLayout.maybe_replan -> retune, before each forward that may sync):
      * the first iteration runs as torch DDP's does (one bucket, or the construction layout with
        find_unused_parameters); from the next forward on, each candidate cap in turn lays out the
        buckets (`layout.plan_with_cap(cap)`: the layout torch DDP would use with that cap) for one untimed step
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

    def retune(self, layout, completed: int) -> None:
        """Before a forward: step the timing; switch the layout's cap, or adopt rank 0's fastest for good.

        Args:
            layout: the reducer's BucketLayout (through its public methods: plan_with_cap, use_cap).
            completed: synced iterations completed on every rank (the clock ticks by it).
        """
        cap = self.step(completed, layout.plan_with_cap)
        if cap is None:  # every candidate timed
            best = torch.tensor([self.fastest()], dtype=torch.int64, device=layout.device)
            if layout.world_size > 1:  # ranks meet here: every rank adopts rank 0's choice
                dist.broadcast(best, src=global_rank(layout.process_group, 0), group=layout.process_group)
            cap = self.chosen = self.candidates[int(best.item())]
        layout.use_cap(cap)  # fresh buckets if the cap changed
