"""The engine's first read is the default step's whole path, and nothing else: checked by a call trace.

One steady step of `minidp.DDP(model)` (a model with buffers, so the forward broadcasts them), traced
with sys.setprofile on 2 real gloo ranks: every engine file a Python function of which runs during
the step must be in minidp/engine/README.md's "## First read", and every first-read file must run.
Along the step, no call goes back into an engine file that an outer frame has left for another
engine file (a callback loop: "a gradient's walk never returns to a file it left").

Outside the engine the step may touch minidp/runtime/watchdog.py only (the progress it reports).
"""
import os
import re
import sys

import torch
from torch import nn

import minidp
from harness import run_ranks
from models import CNNWithBatchNorm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "minidp") + os.sep
ENGINE = os.path.join(PACKAGE, "engine") + os.sep


def _first_read() -> list[str]:
    text = open(os.path.join(ENGINE, "README.md")).read()
    section = text.split("## First read", 1)[1].split("\n## ", 1)[0]
    return list(dict.fromkeys(re.findall(r"`(\w+\.py)`", section)))


class StepTrace:
    """Records which files of minidp/ run, and calls back into an engine file an outer frame left."""

    def __init__(self):
        self.files, self.returns = set(), []
        self.stack = []  # the minidp file of each Python frame entered since tracing began

    def __call__(self, frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            mine = name if name.startswith(PACKAGE) else None
            if mine is not None:
                self.files.add(os.path.relpath(mine, PACKAGE))
                if mine.startswith(ENGINE):
                    self._check_no_return(mine, frame)
            self.stack.append(mine)
        elif event == "return" and self.stack:
            self.stack.pop()

    def _check_no_return(self, name: str, frame) -> None:
        outer = [f for f in self.stack if f is not None and f.startswith(ENGINE)]
        collapsed = [f for i, f in enumerate(outer) if i == 0 or f != outer[i - 1]]
        if collapsed and collapsed[-1] != name and name in collapsed:
            path = " -> ".join(os.path.basename(f) for f in collapsed + [name])
            self.returns.append(f"{path} ({frame.f_code.co_name})")


def _worker():
    torch.manual_seed(0)
    model = minidp.DDP(CNNWithBatchNorm())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 3, 4, 4), torch.randn(4, 4)

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):  # the first step, the rebuild, a steady one
        step()
    trace = StepTrace()
    sys.setprofile(trace)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(trace.files), trace.returns


def test_the_default_step_runs_through_the_first_read_and_nothing_else():
    first = {f"engine/{name}" for name in _first_read()}
    for files, returns in run_ranks(_worker, 2, timeout=120):
        engine = {f for f in files if f.startswith("engine/")}
        assert engine - first == set(), "the default step runs files outside the first read"
        assert first - engine == set(), "first-read files the default step does not run"
        assert set(files) - engine == {"runtime/watchdog.py"}, files
        assert returns == [], f"calls back into an engine file an outer frame left: {returns}"


def test_the_trace_sees_a_return_to_a_file_left():
    """The checker itself: a call from b back into a, with a below b on the stack, is seen."""
    trace = StepTrace()
    a, b = ENGINE + "a.py", ENGINE + "b.py"
    frame = sys._getframe()
    trace.stack = [a, None, b]
    trace._check_no_return(a, frame)
    trace._check_no_return(b, frame)  # a call inside the file on top is fine
    assert trace.returns == ["a.py -> b.py -> a.py (test_the_trace_sees_a_return_to_a_file_left)"]
