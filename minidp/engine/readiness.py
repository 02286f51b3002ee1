"""Readiness policies: what a mode changes in the reducer core, as answers to the same few questions.

The core (reducer.py) asks its policy, and never tests a mode itself:
  * `is_last_hook(step, index)`: the parameter's hook fired; is its gradient final for this step?
  * `at_first_hook(reducer, step)`: anything to do when backward reaches the first hook?
  * `missing_at_end(reducer, step)`: backward ended; which parameters without a gradient are
    reduced as zeros (or raise: the mode forbids them)?
  * `counts_use`: should the step's status all-reduce count, by parameter, the ranks that used it?
  * `after_step(step, used)`: the step succeeded on every rank; which parameters did no rank use
    (their `.grad` is left alone), and in which order did gradients become ready (for the rebuild)?

Three policies, as torch DDP's three modes (modes.choose picks one from the wrapper's keywords):
  EveryParameter   find_unused_parameters=False (default): each parameter, once per backward
  FindUnused       find_unused_parameters=True: missing parameters are reduced as zeros
  StaticGraph      static_graph=True (static_graph.py): counts learned in the first step
and FindUnused's variant SkipUnused (skip_unused.py, skip_all_reduce_unused_params=True): a bucket
wholly unused on this rank is not all-reduced.
"""
from __future__ import annotations


class EveryParameter:
    """The default: every parameter gets exactly one gradient in every synced backward.

    Args:
        names: the reducer's parameter names, for error messages.
    """

    counts_use = False

    def __init__(self, names: list[str]):
        self.names = names

    def is_last_hook(self, step, index: int) -> bool:
        if step.ready[index]:
            raise RuntimeError(f"minidp: parameter {self.names[index]!r} got a gradient twice in one "
                               "backward; each parameter may be reduced once per iteration (unless "
                               "static_graph=True, e.g. for reentrant activation checkpointing)")
        return True

    def at_first_hook(self, reducer, step) -> None:
        pass

    def missing_at_end(self, reducer, step) -> list[int]:
        if len(step.order) == len(step.ready):
            return []  # the usual step: every parameter is ready
        missing = [self.names[i] for i, ready in enumerate(step.ready) if not ready]
        # A failed backward like any other: the next forward closes the step (recovery.py).
        raise RuntimeError(
            f"minidp.DDP: {len(missing)} parameter(s) got no gradient in the last backward: {missing}. "
            "Every parameter must take part in the loss each iteration; otherwise pass "
            "find_unused_parameters=True (unused parameters are then reduced as zeros).")

    def after_step(self, step, used) -> tuple[set, list | None]:
        return set(), step.order


class FindUnused(EveryParameter):
    """find_unused_parameters=True: a parameter without a gradient on this rank is reduced as zeros;
    one that no rank used (counted by the status all-reduce) keeps its `.grad` as it is, as in DDP."""

    counts_use = True

    def missing_at_end(self, reducer, step) -> list[int]:
        return [i for i, ready in enumerate(step.ready) if not ready]

    def after_step(self, step, used) -> tuple[set, list | None]:
        return {i for i, count in enumerate(used) if count == 0}, step.order

