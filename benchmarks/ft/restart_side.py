"""The restart path: `python -m minidp.run --max-restarts K` over restart_worker.py, checkpoints every M steps.

Any failure (an exception, a SIGKILL, or a hang that times out the others' gloo all-reduce) makes
the launcher stop every rank and start them all again; they resume from the last checkpoint, so
the steps since it are done twice and every rank pays a process start, torch's import, the
rendezvous and the checkpoint load. A hang shorter than `hang_timeout` only stalls the step.

    run(schedule, duration_s=60, replicas=3, log_dir="/tmp/logs", run_start=time.time())
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from workload import launch  # noqa: E402

GRACE_S = 30.0  # past the deadline: the ranks stop at their next vote, or the launcher's --timeout ends them


def run(schedule, duration_s: float, replicas: int, log_dir: str, run_start: float, *, every: int = 20,
        hang_s: float = 6.0, hang_timeout: float = 3.0, max_restarts: int = 1000, **_ignored) -> None:
    """Run the restart path until run_start + duration_s; the event logs go to log_dir.

    Args:
        schedule: make_schedule's events (rank r is replica r).
        duration_s: the run's length in seconds.
        replicas: ranks (`--nproc-per-node`).
        log_dir: the event logs' folder; the launcher's output goes to log_dir/launcher.log.
        run_start: the run's start, time.time() seconds.
        every: steps between checkpoints. Default 20.
        hang_s: how long a `hang` sleeps. Default 6.0.
        hang_timeout: the gloo collective timeout (and the rendezvous's), seconds. Default 3.0.
        max_restarts: the launcher's --max-restarts. Default 1000 (never runs out).

    Raises:
        RuntimeError: the launcher ended with a failure (its log is named).
    """
    if replicas < 1:
        raise ValueError(f"replicas={replicas!r} must be >= 1")
    if every < 1:
        raise ValueError(f"every={every!r} must be >= 1")
    os.makedirs(log_dir, exist_ok=True)
    deadline = run_start + duration_s
    with tempfile.TemporaryDirectory(prefix="ft-restart-") as tmp:
        launch(["-m", "minidp.run", "--nproc-per-node", str(replicas), "--max-restarts", str(max_restarts),
                "--timeout", str(deadline + GRACE_S - time.time()), os.path.join(HERE, "restart_worker.py"),
                "--log-dir", log_dir, "--ckpt-dir", tmp, "--schedule", "{schedule}", "--run-start", repr(run_start),
                "--deadline", repr(deadline), "--every", str(every), "--hang-s", str(hang_s),
                "--hang-timeout", str(hang_timeout)], schedule, tmp, log_dir, "restart path: minidp.run")
