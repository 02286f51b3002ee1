"""static_graph=True: torch DDP's promise that every iteration uses the same parameters, as often.

What the promise buys, in torch DDP and here: a parameter may go unused (it is reduced as zeros, with
no find_unused_parameters bookkeeping each step), and a parameter's gradient hook may fire several
times in one backward (reentrant activation checkpointing): the parameter is ready at its last hook.

How, as torch's reducer does it (reducer.cpp: delay_all_reduce, autograd_hook), as a readiness
policy (readiness.py's questions):
  * the first synced backward only counts each parameter's hooks; at its end every gradient goes
    into its bucket (zeros where there was none) and every bucket is reduced. A use count exchanged
    with the step's status says which parameters no rank used: their `.grad` is never written;
  * from then on, the parameters this rank left unused are reduced as zeros at the first hook of each
    backward, and a parameter is ready when its hook has fired as often as in the first iteration.
    One hook more than that means the graph changed: an error;
  * the buckets are rebuilt after the second iteration (not the first), in that iteration's ready
    order, this rank's unused parameters last.
"""
from __future__ import annotations


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

    def at_first_hook(self, reducer, step) -> None:
        # The step's count-down: hooks seen (first iteration) or still expected (later).
        step.hooks = [0] * len(self.names) if self.learning else list(self.hook_counts)
        if self.learning:
            return
        for i in self.unused:  # ready now, as zeros
            step.ready[i] = True
            reducer.reduce_as_zeros(step, i)
        reducer.launch_ready_buckets(step)  # ranks meet here, for buckets of unused parameters only

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

    def missing_at_end(self, reducer, step) -> list[int]:
        if self.learning:  # the first iteration: every gradient into its bucket now, zeros for the rest
            for i, count in enumerate(step.hooks):
                if count:
                    reducer.mark_ready(step, i, reducer.params[i])
            return [i for i, ready in enumerate(step.ready) if not ready]
        missing = [self.names[i] for i, ready in enumerate(step.ready) if not ready]
        if missing:
            raise RuntimeError(
                f"minidp.DDP(static_graph=True): {len(missing)} parameter(s) got fewer gradients in the last "
                f"backward than in the first iteration: {missing}. The graph changed, which static_graph=True "
                "does not allow; use find_unused_parameters=True instead.")
        return []

    def after_step(self, step, used) -> tuple[set, list | None]:
        if self.learning:  # keep the counts; as torch, the buckets are rebuilt after the second iteration
            self.hook_counts = step.hooks
            self.unused = [i for i, count in enumerate(self.hook_counts) if count == 0]
            self.globally_unused = {i for i, count in enumerate(used) if count == 0}
            return self.globally_unused, None
        return self.globally_unused, step.order + self.unused  # this rank's unused parameters last, as torch


def set_static_graph(reducer) -> None:
    """static_graph=True after construction (torch DDP's _set_static_graph), before the first iteration."""
    if reducer.iteration > 0:
        raise RuntimeError("set_static_graph() should be called before training loop starts and after "
                           "DistributedDataParallel is constructed.")  # torch's words
    reducer.readiness = StaticGraph(reducer.names)
    reducer.layout.needs_rebuild = reducer.layout.rebuild_pending = True  # torch's needs_rebuild, now true
