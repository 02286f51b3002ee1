"""A long phase of a benchmark says it is still running: a line on stderr when it starts, then every 30 s.

    with heartbeat("N=4 torch_zero: 3 AdamW steps on 4 ranks"):
        ranks = launch_json(...)

Why: a launch of forked ranks can run for minutes on a loaded machine with nothing to print until its
ranks are done; a silent minute looks like a hang. The lines go to stderr, so the tables on stdout stay
as they were. The beat is a thread that writes with os.write (no Python lock held): the ranks forked
meanwhile cannot inherit a held stream lock.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EVERY_S = 30.0


def _say(text: str) -> None:
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # a captured stderr (pytest in-process): no descriptor
        print(text, file=sys.stderr, flush=True)
    else:
        os.write(fd, f"{text}\n".encode())


@contextlib.contextmanager
def heartbeat(label: str, every_s: float = EVERY_S):
    """Print `label` at the start and `label: still running, T s` every `every_s` seconds until the block ends.

    Args:
        label: what runs, e.g. "N=2 ddp: 3 steps on 2 ranks".
        every_s: seconds between lines. Default 30.
    """
    start = time.monotonic()
    done = threading.Event()
    _say(f"... {label}")

    def beat():
        while not done.wait(every_s):
            _say(f"... {label}: still running, {time.monotonic() - start:.0f} s")

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
