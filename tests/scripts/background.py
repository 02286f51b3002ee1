"""Launcher runs the tests need, started early and run in the background while other tests run.

Why: on this 2-core machine a fifth of the suite's core time was idle (one process compiling, one rank
waiting out a timeout), while the real launches (torchrun, minidp.run, the README's commands, Lightning's
and Accelerate's launchers) ran later, two at a time, with nothing else to do. Now each test file
registers its launches when it is imported (at collection), tests/conftest.py keeps two of them running
between tests from the first test on, and a test that needs one waits for it: started now if it has not
started yet, with up to two launches running while it waits, as before.

    group = prelaunch("readme/line 46", lambda: [Command(...), ...])   # at import: nothing starts yet
    results = group.results()                                         # in a test: [Result, ...]

A group is the Commands of one launch that must start together (two "nodes"). No threads here: the
harness forks test workers only from a single-threaded process (tests/harness.py), and Popen starts
none. Launches of test files that are not selected (-k, a file given on the command line) never start.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

from processes import Command, Result, kill_tree

# Launches running while other tests run; MINIDP_TEST_BACKGROUND=0: none (a launch then starts only when a test
# waits for it). Whole suite on this 2-core machine (2026-12-03, the machine's speed varying by ~15% between
# runs): 0 -> 441 s, 1 -> 389 and 415 s, 2 -> 358 s (then 409-418 s after later changes), 3 -> 428 s. With 2,
# after the suite's launches were cut (evening): 398 s on a slow machine (4 torch imports in 19-20 s), 264 s
# on a quick one (12-15 s).
IN_BACKGROUND = int(os.environ.get("MINIDP_TEST_BACKGROUND", "2"))
WHILE_WAITING = 2  # launches running while a test waits for one


class Group:
    """One launch: make() -> [Command, ...] (started at once), called when the group starts."""

    def __init__(self, key: str, module: str, make: Callable[[], Sequence[Command]]):
        self.key, self.module, self.make = key, module, make
        self.commands: Optional[List[Command]] = None

    @property
    def started(self) -> bool:
        return self.commands is not None

    def running(self) -> bool:
        return self.started and any(c.proc.poll() is None for c in self.commands)

    def start(self) -> None:
        if self.started:
            return
        # As for a CPU test's children (tests/conftest.py): no GPU. A launch starts between tests, where
        # that fixture's setting is not in force.
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self.commands = list(self.make())
        finally:
            if hidden is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = hidden

    def results(self) -> List[Result]:
        """Wait for this launch (starting it first if it has not started); its Results, in order."""
        self.start()
        while self.running() and not any(c.overdue() for c in self.commands):
            pump(WHILE_WAITING)
            time.sleep(0.05)
        return [c.wait() for c in self.commands]  # (a command past its timeout is killed here)


_GROUPS: Dict[str, Group] = {}
_FOLDERS: List[str] = []


def folder(prefix: str) -> str:
    """A new temporary folder for a launch's files, removed by stop_all() at the end of the session."""
    path = tempfile.mkdtemp(prefix=f"minidp-{prefix}-")
    _FOLDERS.append(path)
    return path


def prelaunch(key: str, make: Callable[[], Sequence[Command]], module: str = "") -> Group:
    """Register a launch, to start in the background later (in registration order); returns its Group."""
    if key in _GROUPS:
        raise ValueError(f"a launch named {key!r} is registered twice")
    _GROUPS[key] = Group(key, module, make)
    return _GROUPS[key]


def arrange(modules_in_order) -> None:
    """Once collection is done: forget the launches of test files none of whose tests run, and queue the
    others in the order their files' tests run (a file's launches in the order it registered them)."""
    position = {m: i for i, m in reversed(list(enumerate(modules_in_order)))}  # each file's first test
    kept = sorted((g for g in _GROUPS.values() if not g.module or g.module in position),
                  key=lambda g: position.get(g.module, -1))  # stable
    _GROUPS.clear()
    _GROUPS.update((g.key, g) for g in kept)


def pump(limit: int = IN_BACKGROUND) -> None:
    """Start queued launches until `limit` are running (the next in registration order first)."""
    running = sum(g.running() for g in _GROUPS.values())
    for group in _GROUPS.values():
        if running >= limit:
            return
        if not group.started:
            group.start()
            running += 1


def stop_all() -> None:
    """Kill whatever still runs (a test that failed early left its launch running); remove the folders."""
    for group in _GROUPS.values():
        for command in group.commands or []:
            if command.proc.poll() is None:
                kill_tree(command.proc.pid)
                command.proc.wait()
    for path in _FOLDERS:
        shutil.rmtree(path, ignore_errors=True)
