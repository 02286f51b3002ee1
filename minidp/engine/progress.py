"""What a step reports as it goes: where this rank is, for the watchdog; torch's logging samples.

The reducer reports a few events to a recorder (never `if timeline`): a forward starts or ends, a
gradient is ready, a bucket is launched or its future watched, backward ends, finalize ends.
`RecorderOff` does nothing. Under minidp.init(), which starts a watchdog (runtime/watchdog.py),
the reducer reports to a `ProgressRecorder`: three fields of the watchdog's `Progress` a forward, a
bucket launch and the end of backward, never per gradient. When a collective fails or hangs, the
watchdog's `report` names the ranks that did not arrive, where they are, and their Python stacks.
`model.enable_timeline()` swaps in timeline.py's recorder, which records every event.

`RuntimeSamples`, a forward pre-hook on the wrapper, samples the reducer's state as torch DDP's
logger does, for model._get_ddp_logging_data() (compat.py): at synced iterations 1 to 10, then every
`sample_rate`-th (100, model._set_ddp_runtime_logging_sample_rate).
"""
from __future__ import annotations

import torch

from ..runtime.watchdog import current


class RecorderOff:
    """What the reducer reports to when nothing records: every method does nothing."""

    def forward(self, iteration: int, armed: bool) -> None:
        """A forward starts (`armed` False) or ends (`armed`: a synced backward comes next)."""

    def grad_ready(self, name: str, bucket: int) -> None:
        """Parameter `name`'s gradient is final this step; it goes to bucket `bucket`."""

    def launch(self, iteration: int, bucket: int) -> None:
        """Bucket `bucket` is about to be reduced."""

    def watch(self, bucket: int, future) -> None:
        """`future` is bucket `bucket`'s reduction."""

    def event(self, kind: str, iteration: int) -> None:
        """"backward_end", "finalize_end" or "failed_iteration_closed"."""


OFF = RecorderOff()


class ProgressRecorder(RecorderOff):
    """The reducer's events as the watchdog's progress (Args: progress, the watchdog's Progress)."""

    def __init__(self, progress):
        self.progress = progress

    def forward(self, iteration: int, armed: bool) -> None:
        if armed:
            self.progress.update(iteration, "backward")
        else:
            self.progress.update(iteration + 1, "forward")

    def launch(self, iteration: int, bucket: int) -> None:
        self.progress.update(iteration, "backward", bucket)

    def event(self, kind: str, iteration: int) -> None:
        if kind == "backward_end":  # waiting for the buckets
            self.progress.update(iteration, "finalize", self.progress.bucket)
        elif kind == "finalize_end":
            self.progress.update(iteration, "after backward")


def recorder_for(world_size: int) -> RecorderOff:
    """A ProgressRecorder if minidp.init() started a watchdog (and there are peers), else OFF."""
    watchdog = current()  # the runtime's (minidp.init starts it): the engine keeps none
    return OFF if watchdog is None or world_size == 1 else ProgressRecorder(watchdog.progress)


def report(what: str) -> str:
    """The watchdog's report for a failed wait ("" without a watchdog), to end an error message.

    Args:
        what: what the rank waited in, e.g. "the all-reduce of bucket 0".
    """
    watchdog = current()
    return "" if watchdog is None else "\n" + watchdog.report(what)


class RuntimeSamples:
    """The sample of the reducer's state taken before sampled synced forwards (a forward pre-hook).

    Args:
        ddp: the wrapper; the hook is registered on it.
    """

    def __init__(self, ddp):
        self.sample_rate = 100  # torch's kDDPRuntimeLoggingSampleRate
        self.sample = {}
        self.error = None  # the last error raised through log_and_raise, in torch's format
        ddp.register_forward_pre_hook(self.before_forward)

    def before_forward(self, ddp, inputs) -> None:
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return  # torch counts and samples synced forwards only
        known = ddp.reducer.describe()
        iteration = known["iteration"]  # synced forwards before this one
        if iteration == 0 or (iteration > 10 and iteration % self.sample_rate):
            return
        plan = known["plan"]
        skipped = known["skipped_buckets"]  # skip_all_reduce_unused_params (readiness.py)
        first_static = ddp.static_graph and iteration == 1  # torch counts none in that iteration
        self.sample = {"iteration": iteration,
                       "has_rebuilt_buckets": int(known["rebuilt"]),
                       "num_buckets_reduced": 0 if first_static else len(plan) - skipped}
        if self.sample["has_rebuilt_buckets"]:
            self.sample["rebuilt_bucket_sizes"] = bucket_sizes(known["params"], plan)
            self.sample["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, bucket)) for bucket in plan)


def bucket_sizes(params, plan) -> str:
    """Each bucket's bytes, as torch's logger writes them."""
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in plan]
    return ", ".join(map(str, sizes))
