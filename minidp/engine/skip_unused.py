"""skip_all_reduce_unused_params=True: a bucket whose parameters all went unused is not all-reduced.

What it changes in the core: the readiness policy (find_unused_parameters=True's, readiness.py),
at the end of backward. torch DDP >= 2.14 (`Reducer::should_skip_all_reduce_bucket`,
`finalize_backward`): a bucket all of whose parameters this rank found unused in this iteration
issues no all-reduce and is not written back, so its parameters' `.grad` stay as they are (None,
or what accumulated before); the step's other buckets and the unused-parameter all-reduce (here,
the status exchange, recovery.py) are as with find_unused_parameters=True alone. Every rank must
leave the same parameters unused (torch's documented condition): a rank that skips a bucket that
another rank reduces leaves the ranks out of step, as in torch DDP.

Without find_unused_parameters=True torch finds no unused parameter, so the keyword changes
nothing; with static_graph=True minidp refuses it (`check_skip`).
"""
from __future__ import annotations

import torch

from ..validate import check_bool
from .readiness import FindUnused


def check_skip(value, static_graph: bool) -> bool:
    """The keyword's value if minidp does what torch does with it, else TypeError/ValueError."""
    check_bool("skip_all_reduce_unused_params", value)
    if value and static_graph:
        raise ValueError("minidp.DDP does not support skip_all_reduce_unused_params=True with "
                         "static_graph=True; use it with find_unused_parameters=True")
    return value


class SkipUnused(FindUnused):
    """find_unused_parameters=True, less the all-reduce of buckets this rank left wholly unused."""

    def missing_at_end(self, reducer, step) -> list[int]:
        missing = set(super().missing_at_end(reducer, step))
        step.skipped = set()  # parameters of the skipped buckets: not written back
        self.skipped_buckets = 0  # this step's, for model._get_ddp_logging_data() (logging_data.py)
        for bucket in reducer.layout.buckets[len(step.futures):]:
            if all(i in missing for i in bucket.param_indices):
                reducer.launch_ready_buckets(step, at_end=True)  # those before it, in order
                step.pending[bucket.index] = 0
                step.futures.append(finished(bucket.buffer))  # no collective, no write-back
                step.skipped.update(bucket.param_indices)
                self.skipped_buckets += 1
                continue
            for i in bucket.param_indices:
                if i in missing:
                    reducer.reduce_as_zeros(step, i)
        return []

    def after_step(self, step, used) -> tuple[set, list | None]:
        unused, order = super().after_step(step, used)
        return unused | step.skipped, order


def finished(value: torch.Tensor) -> torch.futures.Future:
    """A future that holds `value` already: what a skipped bucket 'reduces' to."""
    future = torch.futures.Future()
    future.set_result(value)
    return future
