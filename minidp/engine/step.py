"""One synced step's state (`Step`), and the default readiness policy that reads it.

The reducer arms a fresh Step before each synced backward and drops it when the step ends, so no
state of one step leaks into the next. A mode changes the reducer through its readiness policy: the
reducer asks the policy, the policy answers from the Step, the reducer acts.
"""
from __future__ import annotations

from .buckets import Divisor


class Step:
    """One synced step's state: made when the step is armed, dropped when it ends."""

    def __init__(self, buckets: list, n_params: int, divisor: Divisor | None):
        self.divisor = divisor  # what gradients are divided by as copied in (None: a comm hook's)
        self.pending = [len(b.param_indices) for b in buckets]  # by bucket: gradients to come
        self.waiting = [[] for _ in buckets]  # by bucket: (slot, grad), small, copied at launch
        self.futures = []                     # by launched bucket, in order
        self.ready = [False] * n_params       # by parameter: its gradient is in its bucket
        self.order = []                       # parameters in the order they became ready
        self.started = False  # a hook fired: finalize is queued, collectives may be in flight

    @property
    def launched(self) -> int:
        """Buckets launched so far; buckets launch in index order, so the next one is this index."""
        return len(self.futures)


class EveryParameter:
    """The default readiness policy: every parameter gets one gradient in every synced backward.

    The reducer asks its policy, never tests a mode; the policy answers, the reducer acts:
    `is_last_hook` (is this hook the parameter's last this step?), `at_first_hook` (parameters
    ready now, as zeros), `at_end` (at the end of backward: parameters whose gradients go in now,
    those reduced as zeros, buckets not reduced at all; or an error), `counts_use` (does the step
    count each parameter's users?), `after_step` (parameters no rank used, the ready order; where
    the step counts no use, asked before the waits, ahead of the verdict: it must change nothing).
    readiness.py answers for find_unused_parameters, skip_all_reduce_unused_params, static_graph.

    Args:
        names: the reducer's parameter names, for error messages.
    """

    counts_use = False

    def __init__(self, names: list[str]):
        self.names = names

    def is_last_hook(self, step: Step, index: int) -> bool:
        if step.ready[index]:
            raise RuntimeError(
                f"minidp: parameter {self.names[index]!r} got a gradient twice in one backward; "
                "each parameter may be reduced once per iteration (unless static_graph=True, e.g. "
                "for reentrant activation checkpointing)")
        return True

    def at_first_hook(self, step: Step) -> list[int]:
        return []

    def at_end(self, step: Step, unlaunched: dict) -> tuple[list, list, list]:
        """(gradients in now, reduced as zeros, buckets skipped); `unlaunched`: bucket -> params."""
        if len(step.order) == len(step.ready):
            return [], [], []  # the usual step: every parameter is ready
        missing = [self.names[i] for i, ready in enumerate(step.ready) if not ready]
        # A failed backward like any other: the next forward closes the step (close_failed_step).
        raise RuntimeError(
            f"minidp.DDP: {len(missing)} parameter(s) got no gradient in the last backward: "
            f"{missing}. Every parameter must take part in the loss each iteration; otherwise pass "
            "find_unused_parameters=True (unused parameters are then reduced as zeros).")

    def after_step(self, step: Step, used) -> tuple[set, list | None]:
        return set(), step.order
