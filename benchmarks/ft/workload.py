"""The fault-tolerance benchmarks' shared workload: one model, one dataset, one failure schedule.

Every mode measured side by side (minidp.ft, `minidp.run --max-restarts` with checkpoints, torchft's
DDP) trains this model on this data and meets the same failures at the same wall times, injected
by `Injector` inside the training process itself:
  exception  the step raises RuntimeError (inside backward's reach: after forward, before backward)
  kill       the process SIGKILLs itself mid-step (no cleanup, no exception: as a lost machine)
  hang       the process sleeps `hang_s` mid-step (a stuck rank), then goes on
"""
from __future__ import annotations

import json
import os
import random
import signal
import time

import torch
from torch import nn

KINDS = ("exception", "kill", "hang")
FEATURES, WIDTH, CLASSES = 256, 1024, 10


def make_model(seed: int = 0, width: int = WIDTH) -> nn.Module:
    """The benchmark's MLP (1.3 M parameters at the default width), the same weights for the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


def make_data(samples: int = 8192, seed: int = 1):
    """A synthetic classification set: inputs and the labels a fixed random linear map gives them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x, y


def make_schedule(failures: int, duration_s: float, replicas: int, seed: int = 0,
                  kinds=KINDS, start_s: float = 2.0, gap_s: float = 0.0) -> list:
    """`failures` events at uniformly random times in [start_s, duration_s), kinds and replicas at random.

    Args:
        gap_s: the least time between two events (0: any), so a failure is not injected into the
            recovery of the one before when a benchmark wants them apart. Default 0.
    """
    rng = random.Random(seed)
    times = sorted(rng.uniform(start_s, duration_s) for _ in range(failures))
    for i in range(1, len(times)):
        times[i] = max(times[i], times[i - 1] + gap_s)
    return [{"at_s": round(t, 3), "replica": rng.randrange(replicas), "kind": kinds[i % len(kinds)]}
            for i, t in enumerate(times)]


class InjectedFailure(RuntimeError):
    """The exception an `exception` event raises."""


class Injector:
    """Fires this replica's events of a schedule when their wall time (since the run's start) has come.

    A restarted process makes a new Injector: the events whose time passed before it started
    belonged to earlier processes and are skipped.

    Args:
        schedule: make_schedule's list (or a path to its JSON).
        replica: this process's replica id.
        run_start: the run's start, time.time() seconds, the same for every process.
        hang_s: how long a `hang` sleeps. Default 6.0.
    """

    def __init__(self, schedule, replica: int, run_start: float, hang_s: float = 6.0):
        if isinstance(schedule, (str, os.PathLike)):
            with open(schedule) as f:
                schedule = json.load(f)
        born = time.time() - run_start
        self.events = [e for e in schedule if e["replica"] == replica and e["at_s"] > born]
        self.run_start, self.hang_s = run_start, hang_s

    def poll(self) -> None:
        """Fire every event that is due: raise, SIGKILL this process, or sleep."""
        now = time.time() - self.run_start
        while self.events and self.events[0]["at_s"] <= now:
            kind = self.events.pop(0)["kind"]
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(self.hang_s)
            else:
                raise InjectedFailure(f"injected failure at {now:.2f} s")


def launch(cmd: list, schedule, folder: str, log_dir: str, what: str) -> None:
    """Write `schedule` to folder/schedule.json, run `cmd` (its output to log_dir/launcher.log), check it.

    `cmd` names the schedule's file as the string "{schedule}".

    Raises:
        RuntimeError: the command exited non-zero (its log is named).
    """
    import subprocess
    import sys
    path = os.path.join(folder, "schedule.json")
    with open(path, "w") as f:
        json.dump(list(schedule), f)
    launcher_log = os.path.join(log_dir, "launcher.log")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(launcher_log, "ab") as out:
        code = subprocess.call([sys.executable, *[c.replace("{schedule}", path) for c in cmd]], cwd=root,
                               stdout=out, stderr=subprocess.STDOUT)
    if code != 0:
        raise RuntimeError(f"{what} exited with {code}; its output: {launcher_log}")
