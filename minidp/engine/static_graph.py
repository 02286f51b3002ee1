"""static_graph=True: torch DDP's promise that every iteration uses the same parameters, as often.

What the promise buys, in torch DDP and here: a parameter may go unused (it is reduced as zeros, with
no find_unused_parameters bookkeeping each step), and a parameter's gradient hook may fire several
times in one backward (reentrant activation checkpointing): the parameter is ready at its last hook.

How, as torch's reducer does it (reducer.cpp: delay_all_reduce, autograd_hook):
  * the first synced backward only counts each parameter's hooks; at its end every gradient goes
    into its bucket (zeros where there was none) and every bucket is reduced. A use count exchanged
    with the iteration's status says which parameters no rank used: their `.grad` is never written;
  * from then on, the parameters this rank left unused are reduced as zeros at the first hook of each
    backward, and a parameter is ready when its hook has fired as often as in the first iteration.
    One hook more than that means the graph changed: an error;
  * the buckets are rebuilt after the second iteration (not the first), in that iteration's ready
    order, this rank's unused parameters last.
"""
from __future__ import annotations


class StaticGraph:
    """The hook counts learned in the first synced backward, and this iteration's count-down.

    Args:
        names: the reducer's parameter names, for error messages.
    """

    def __init__(self, names: list[str]):
        self.names = names
        self.hook_counts = None         # hooks per parameter per iteration; None until learned
        self.unused = []                # parameters this rank gave no gradient in the first iteration
        self.globally_unused = set()    # parameters no rank used: their .grad is never written
        self.counts = [0] * len(names)  # hooks seen (first iteration) or still expected (later)

    @property
    def learning(self) -> bool:
        """True until the first synced backward has completed on every rank."""
        return self.hook_counts is None

    def start_iteration(self) -> None:
        self.counts = [0] * len(self.names) if self.learning else list(self.hook_counts)

    def last_hook(self, index: int) -> bool:
        """Count one hook of parameter `index`: whether it was its last in this iteration."""
        if self.learning:
            self.counts[index] += 1
            return False  # the first iteration reduces everything at its end
        if self.counts[index] == 0:
            raise RuntimeError(
                f"minidp.DDP(static_graph=True): parameter {self.names[index]!r} got more gradients in this "
                f"backward than in the first iteration ({self.hook_counts[index]}): the graph changed (e.g. a "
                "parameter unused in the first iteration is used now). Use find_unused_parameters=True instead.")
        self.counts[index] -= 1
        return self.counts[index] == 0

    def learn(self, used_by_ranks: list[int]) -> None:
        """The first iteration completed: keep its counts; `used_by_ranks[i]`: how many ranks used parameter i."""
        self.hook_counts = self.counts
        self.unused = [i for i, count in enumerate(self.hook_counts) if count == 0]
        self.globally_unused = {i for i, count in enumerate(used_by_ranks) if count == 0}

    def missing_message(self, missing: list[int]) -> str:
        names = [self.names[i] for i in missing]
        return (f"minidp.DDP(static_graph=True): {len(names)} parameter(s) got fewer gradients in the last backward "
                f"than in the first iteration: {names}. The graph changed, which static_graph=True does not "
                "allow; use find_unused_parameters=True instead.")
