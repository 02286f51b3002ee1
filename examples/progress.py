"""Rank 0's progress through a long loop: a tqdm bar on a terminal, else a plain line every few steps.

Shared by the examples that run for minutes (train_torchvision.py and train_dali.py through common.py,
custom_hook.py; train_lm.py adds rate_and_eta to its own step lines), so that none is silent until its
first result.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

import minidp


def duration(seconds: float) -> str:
    """A short human duration: "40 s", "3.5 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def rate_and_eta(done: int, total: int, elapsed_s: float) -> str:
    """E.g. "0.24 steps/s, ETA 2.5 min": the mean rate so far, and the time the remaining steps take at it."""
    rate = done / max(elapsed_s, 1e-9)
    return f"{rate:.2f} steps/s, ETA {duration((total - done) / rate) if done else '?'}"


class Progress:
    """Rank 0's progress through `total` steps: a tqdm bar on a terminal, else a line every `every` steps.

    A log file gets plain lines instead (a bar's carriage returns garble it), each with the rate and the
    time left: every `every` steps, but at most one per `interval_s`, so a fast loop (the demo's epochs
    take seconds) does not flood it. The other ranks show nothing.

    Args:
        total: the steps to come.
        desc: what is counted, e.g. "epoch 1/3".
        every: steps between two plain lines (default: a tenth of total).
        show: whether this process shows it (default: only rank 0, minidp.is_main()).
        interval_s: the least time between two plain lines (default 10 s).

    Example:
        progress = Progress(len(loader), f"epoch {epoch + 1}/{epochs}")
        for x, y in loader:
            ...
            progress.step(loss=f"{loss.item():.3f}")   # name=value pairs are optional, kept until replaced
        progress.close()
    """

    def __init__(self, total: int, desc: str, every: int | None = None, show: bool | None = None,
                 interval_s: float = 10.0):
        self.total, self.desc, self.done, self.postfix = total, desc, 0, {}
        self.every, self.interval_s = every or max(1, total // 10), interval_s
        self.show = minidp.is_main() if show is None else show
        self.start = self.printed = time.perf_counter()
        self.bar = None
        if self.show and sys.stdout.isatty():
            self.bar = tqdm(total=total, desc=desc, leave=False, file=sys.stdout, dynamic_ncols=True)

    def step(self, **postfix) -> None:
        """One step done; `postfix` (name=value) is shown beside the count from now on."""
        self.done += 1
        self.postfix.update(postfix)
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=False)
            self.bar.update()
        elif self.show and self.done % self.every == 0 and time.perf_counter() - self.printed >= self.interval_s:
            print(self.line(), flush=True)
            self.printed = time.perf_counter()

    def line(self) -> str:
        """E.g. "epoch 1/3: step 10/46, 0.24 steps/s, ETA 2.5 min, loss 1.234"."""
        extra = "".join(f", {name} {value}" for name, value in self.postfix.items())
        elapsed = time.perf_counter() - self.start
        return f"{self.desc}: step {self.done}/{self.total}, {rate_and_eta(self.done, self.total, elapsed)}{extra}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
