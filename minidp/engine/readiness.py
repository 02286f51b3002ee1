"""The readiness policies of the modes: find_unused_parameters, skip_all_reduce_unused_params, static_graph.

The reducer asks its policy the same few questions, and never tests a mode itself (step.py's
`EveryParameter`, the default, lists them). arguments.choose picks one from the wrapper's keywords:
  FindUnused    find_unused_parameters=True: a parameter without a gradient on this rank is reduced
                as zeros; the step all-reduces each parameter's use count, as torch DDP's unused-
                parameter all-reduce, and one that no rank used keeps its `.grad` as it is
  SkipUnused    its variant, skip_all_reduce_unused_params=True: a bucket this rank left wholly
                unused is not all-reduced (torch DDP >= 2.14)
  StaticGraph   static_graph=True: hook counts learned in the first step, unused parameters ready
                at the first hook, the buckets rebuilt after the second step
"""
from __future__ import annotations

from ..validate import check_bool
from .step import EveryParameter


class FindUnused(EveryParameter):
    """find_unused_parameters=True: a parameter without a gradient on this rank is reduced as zeros;
    one that no rank used (counted by the status all-reduce) keeps its `.grad` as it is, as in DDP."""

    counts_use = True

    def at_end(self, step, unlaunched: dict) -> tuple[list, list, list]:
        return [], [i for i, ready in enumerate(step.ready) if not ready], []

    def after_step(self, step, used) -> tuple[set, list | None]:
        return {i for i, count in enumerate(used) if count == 0}, step.order


# skip_all_reduce_unused_params=True: a bucket whose parameters all went unused is not all-reduced.
#
# What it changes in the core: the readiness policy (find_unused_parameters=True's, above),
# at the end of backward. torch DDP >= 2.14 (`Reducer::should_skip_all_reduce_bucket`,
# `finalize_backward`): a bucket all of whose parameters this rank found unused in this iteration
# issues no all-reduce and is not written back, so its parameters' `.grad` stay as they are (None,
# or what accumulated before); the step's other buckets and the unused-parameter all-reduce (here,
# the status exchange, failures.py) are as with find_unused_parameters=True alone. Every rank must
# leave the same parameters unused (torch's documented condition): a rank that skips a bucket that
# another rank reduces leaves the ranks out of step, as in torch DDP.
#
# Without find_unused_parameters=True torch finds no unused parameter, so the keyword changes
# nothing; with static_graph=True minidp refuses it (`check_skip`).

def check_skip(value, static_graph: bool) -> bool:
    """The keyword's value if minidp does what torch does with it, else TypeError/ValueError."""
    check_bool("skip_all_reduce_unused_params", value)
    if value and static_graph:
        raise ValueError("minidp.DDP does not support skip_all_reduce_unused_params=True with "
                         "static_graph=True; use it with find_unused_parameters=True")
    return value


class SkipUnused(FindUnused):
    """find_unused_parameters=True, less the all-reduce of buckets this rank left wholly unused."""

    def at_end(self, step, unlaunched: dict) -> tuple[list, list, list]:
        missing = set(super().at_end(step, unlaunched)[1])
        skip = [b for b, ids in unlaunched.items() if all(i in missing for i in ids)]
        step.skipped = {i for b in skip for i in unlaunched[b]}  # not written back
        return [], sorted(missing - step.skipped), skip

    def after_step(self, step, used) -> tuple[set, list | None]:
        unused, order = super().after_step(step, used)
        return unused | step.skipped, order


# static_graph=True: torch DDP's promise that every iteration uses the same parameters, as often.
#
# What the promise buys, in torch DDP and here: a parameter may go unused (it is reduced as zeros, with
# no find_unused_parameters bookkeeping each step), and a parameter's gradient hook may fire several
# times in one backward (reentrant activation checkpointing): the parameter is ready at its last hook.
#
# How, as torch's reducer does it (`Reducer::delay_all_reduce`, `autograd_hook`), as a readiness
# policy (the questions reducer.EveryParameter lists):
#   * the first synced backward only counts each parameter's hooks; at its end every gradient goes
#     into its bucket (zeros where there was none) and every bucket is reduced. A use count exchanged
#     with the step's status says which parameters no rank used: their `.grad` is never written;
#   * from then on, the parameters this rank left unused are reduced as zeros at the first hook of each
#     backward, and a parameter is ready when its hook has fired as often as in the first iteration.
#     One hook more than that means the graph changed: an error;
#   * the buckets are rebuilt after the second iteration (not the first), in that iteration's ready
#     order, this rank's unused parameters last.

class StaticGraph:
    """The hook counts learned in the first synced backward, and each step's count-down.

    Args:
        names: the reducer's parameter names, for error messages.
    """

    def __init__(self, names: list[str]):
        self.names = names
        self.hook_counts = None         # hooks per parameter per iteration; None until learned
        self.unused = []                # parameters this rank gave no gradient in the first iteration
        self.globally_unused = set()    # parameters no rank used: their .grad is never written

    @property
    def learning(self) -> bool:
        """True until the first synced backward has completed on every rank."""
        return self.hook_counts is None

    @property
    def counts_use(self) -> bool:
        return self.learning  # which parameters no rank uses is learned once

    def at_first_hook(self, step) -> list[int]:
        # The step's count-down: hooks seen (first iteration) or still expected (later).
        step.hooks = [0] * len(self.names) if self.learning else list(self.hook_counts)
        return [] if self.learning else self.unused  # ready now, as zeros

    def is_last_hook(self, step, index: int) -> bool:
        """Count one hook of parameter `index`: whether it was its last in this iteration."""
        if self.learning:
            step.hooks[index] += 1
            return False  # the first iteration reduces everything at its end
        if step.hooks[index] == 0:
            raise RuntimeError(
                f"minidp.DDP(static_graph=True): parameter {self.names[index]!r} got more gradients in this "
                f"backward than in the first iteration ({self.hook_counts[index]}): the graph changed (e.g. a "
                "parameter unused in the first iteration is used now). Use find_unused_parameters=True instead.")
        step.hooks[index] -= 1
        return step.hooks[index] == 0

    def at_end(self, step, unlaunched: dict) -> tuple[list, list, list]:
        if self.learning:  # the first iteration: every gradient into its bucket now, zeros for the rest
            counted = [i for i, count in enumerate(step.hooks) if count]
            return counted, [i for i, count in enumerate(step.hooks) if not count], []
        missing = [self.names[i] for i, ready in enumerate(step.ready) if not ready]
        if missing:
            raise RuntimeError(
                f"minidp.DDP(static_graph=True): {len(missing)} parameter(s) got fewer gradients in the last "
                f"backward than in the first iteration: {missing}. The graph changed, which static_graph=True "
                "does not allow; use find_unused_parameters=True instead.")
        return [], [], []

    def after_step(self, step, used) -> tuple[set, list | None]:
        if self.learning:  # keep the counts; as torch, the buckets are rebuilt after the second iteration
            self.hook_counts = step.hooks
            self.unused = [i for i, count in enumerate(self.hook_counts) if count == 0]
            self.globally_unused = {i for i, count in enumerate(used) if count == 0}
            return self.globally_unused, None
        return self.globally_unused, step.order + self.unused  # this rank's unused parameters last, as torch
