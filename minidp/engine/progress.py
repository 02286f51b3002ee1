"""Where this rank is in its step, for the watchdog that names a stuck or lost rank (minidp/runtime/watchdog.py).

What it changes in the core: while no timeline records, the reducer's recorder (timeline.py's slot)
is a `ProgressRecorder`, and the wrapper has a forward pre-hook and a forward hook. They write three
fields into the watchdog's `Progress` per forward, per bucket launch and at the end of backward;
never per gradient (`grad_ready` does nothing, as OFF's). recovery.py's failure messages append the
watchdog's report: which ranks did not arrive, where they are, their Python stacks. Without
minidp.init() (torch's init_process_group) there is no watchdog and nothing is attached.
"""
from __future__ import annotations

import torch

from ..runtime.watchdog import current
from .timeline import RecorderOff


class ProgressRecorder(RecorderOff):
    """The reducer's events as progress: bucket launches and the end of backward.

    Args:
        progress: the watchdog's Progress (iteration, phase, bucket).
        reducer: whose iteration count is read at each event.
    """

    def __init__(self, progress, reducer):
        self.progress, self.reducer = progress, reducer

    def launch(self, bucket: int) -> None:
        self.progress.update(self.reducer.iteration, "backward", bucket)

    def event(self, kind: str) -> None:
        """"backward_end": waiting for the buckets; "finalize_end": the step's backward is done."""
        if kind == "backward_end":
            self.progress.update(self.reducer.iteration, "finalize", self.progress.bucket)
        elif kind == "finalize_end":
            self.progress.update(self.reducer.iteration, "after backward")


def _forward_starts(module, args) -> None:
    recorder = module.reducer.recorder
    if isinstance(recorder, ProgressRecorder) and not torch.compiler.is_compiling():
        recorder.progress.update(module.reducer.iteration + 1, "forward")


def _forward_ends(module, args, output) -> None:
    recorder = module.reducer.recorder
    armed = module.reducer.step is not None  # a synced backward comes next
    if isinstance(recorder, ProgressRecorder) and armed and not torch.compiler.is_compiling():
        recorder.progress.update(module.reducer.iteration, "backward")


def track_progress(ddp) -> None:
    """Report `ddp`'s progress to the default group's watchdog, if minidp.init() started one.

    Args:
        ddp: the minidp.DistributedDataParallel whose reducer was just built (again, after unpickling).
    """
    watchdog = current()  # the runtime's (minidp.init starts it): the engine keeps none
    if watchdog is None or ddp.reducer.world_size == 1:
        return
    ddp.reducer.recorder = ProgressRecorder(watchdog.progress, ddp.reducer)
    hooks = list(ddp._forward_pre_hooks.values()) + list(ddp._forward_hooks.values())
    if _forward_starts not in hooks:  # module-level functions: a pickled wrapper keeps them, once
        ddp.register_forward_pre_hook(_forward_starts)
        ddp.register_forward_hook(_forward_ends)


def report(reducer, what: str) -> str:
    """The watchdog's report for a failed wait of `reducer` ("" without a watchdog), to end an error message.

    Args:
        reducer: the reducer whose collective failed.
        what: what it waited in, e.g. "the all-reduce of bucket 0".
    """
    watchdog = current()
    if watchdog is None:
        return ""
    return "\n" + watchdog.report(what)
