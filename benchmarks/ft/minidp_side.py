"""minidp.ft's runner for the goodput benchmark and the soak: `python -m minidp.run --ft` over minidp_worker.py.

A kill restarts only the killed replica (which heals from a live peer); an exception discards one
step on every participant and restarts nothing; a hang longer than `timeout` discards the step
and the hung replica is left out until it wakes and heals.

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

GRACE_S = 60.0


def run(schedule, duration_s: float, replicas: int, log_dir: str, run_start: float, *, hang_s: float = 6.0,
        hang_timeout: float = 3.0, join_timeout: float = 3.0, max_restarts: int = 100000, record=None,
        min_replicas: int = 1, width: int = 1024, **_ignored) -> None:
    """Run minidp.ft until run_start + duration_s; the event logs go to log_dir.

    Args:
        schedule: make_schedule's events.
        duration_s: the run's length in seconds.
        replicas: replicas (one process each).
        log_dir: the event logs' folder; the launcher's output goes to log_dir/launcher.log.
        run_start: the run's start, time.time() seconds.
        hang_s: how long a `hang` sleeps. Default 6.0.
        hang_timeout: collectives' and transfers' timeout between replicas, seconds. Default 3.0.
        join_timeout: how long a round waits for a silent replica. Default 3.0 (torchft_side.py's too).
        max_restarts: restarts of single replicas in the whole run. Default 100000.
        record: a folder to record every round in, for the replay (soak.py). Default None.
        min_replicas: the fewest replicas a round trains with. Default 1.
        width: the workload MLP's width. Default 1024 (the goodput benchmark's model).

    Raises:
        RuntimeError: the launcher ended with a failure (its log is named).
    """
    os.makedirs(log_dir, exist_ok=True)
    deadline = run_start + duration_s
    with tempfile.TemporaryDirectory(prefix="ft-minidp-") as tmp:
        launch(["-m", "minidp.run", "--ft", "--nproc-per-node", str(replicas), "--max-restarts", str(max_restarts),
                "--min-replicas", str(min_replicas), "--join-timeout", str(join_timeout),
                "--timeout", str(deadline + GRACE_S - time.time()), os.path.join(HERE, "minidp_worker.py"),
                "--log-dir", log_dir, "--schedule", "{schedule}", "--run-start", repr(run_start),
                "--deadline", repr(deadline), "--hang-s", str(hang_s), "--timeout", str(hang_timeout),
                "--width", str(width)] + (["--record", record] if record else []), schedule, tmp, log_dir,
               "minidp.ft: minidp.run --ft")
