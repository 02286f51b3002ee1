"""torchft 0.2.0's DDP on the same workload: a lighthouse, one process per replica group, a dead one restarted alone.

torchft has no launcher (in production each replica group runs under its own torchrun, which
restarts that group only); here `run` is that supervisor for replica groups of one process each:
it starts the lighthouse (torchft's Rust server, in this process), starts torchft_worker.py once
per replica, and restarts a replica whose process ended before the deadline, leaving the others
running. The survivors carry on in a smaller quorum; the restarted one heals from a live peer.

    run(schedule, duration_s=60, replicas=3, log_dir="/tmp/logs", run_start=time.time())

The lighthouse's knobs set how fast a failure is noticed: a killed replica stops heartbeating and
leaves the quorum after `heartbeat_ms`; a hung one keeps heartbeating (its Manager server is a
Rust thread), so the others' next quorum waits up to `join_timeout_ms` for it before going on
without it. torchft's defaults are 5 s and 60 s; the defaults here scale them to the benchmark's
`hang_timeout` (3 s): 1 s and hang_timeout.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
POLL_S = 0.02
GRACE_S = 20.0  # past the deadline: a replica ends at its next step, or is killed


def run(schedule, duration_s: float, replicas: int, log_dir: str, run_start: float, *, hang_s: float = 6.0,
        hang_timeout: float = 3.0, heartbeat_ms: int = 1000, join_timeout_ms: int = None, min_replicas: int = 1,
        fix_dummy_work: bool = False, **_ignored) -> None:
    """Run torchft's DDP until run_start + duration_s, restarting dead replicas alone; logs go to log_dir.

    Args:
        schedule: make_schedule's events.
        duration_s: the run's length in seconds.
        replicas: replica groups (one process each).
        log_dir: the event logs' folder; each replica's output goes to log_dir/replica<r>.out.
        run_start: the run's start, time.time() seconds.
        hang_s: how long a `hang` sleeps. Default 6.0.
        hang_timeout: the gloo collective timeout and the Manager's, seconds. Default 3.0.
        heartbeat_ms: the lighthouse's heartbeat timeout. Default 1000.
        join_timeout_ms: how long a quorum waits for heartbeating stragglers. Default None: hang_timeout.
        min_replicas: the lighthouse's least quorum. Default 1.
        fix_dummy_work: train with torchft_ddp_fix.py's DDP, whose comm hook survives an error in
            the step (torchft 0.2.0's raises, and the survivors of a failure die). Default False.

    Raises:
        ImportError: torchft is not installed (`pip install -e '.[ft-bench]'`).
    """
    # torchft's Rust side logs every quorum and commit at INFO on stderr, read when it is imported:
    # at 3 replicas and ~20 steps/s that is CPU the other modes do not spend. RUST_LOG set: kept.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    if replicas < 1:
        raise ValueError(f"replicas={replicas!r} must be >= 1")
    join_timeout_ms = int(hang_timeout * 1000) if join_timeout_ms is None else join_timeout_ms
    os.makedirs(log_dir, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=heartbeat_ms)
    deadline = run_start + duration_s
    try:
        with tempfile.TemporaryDirectory(prefix="ft-torchft-") as tmp:
            schedule_path = os.path.join(tmp, "schedule.json")
            with open(schedule_path, "w") as f:
                json.dump(list(schedule), f)
            args = ["--replicas", str(replicas), "--lighthouse", lighthouse.address(), "--log-dir", log_dir,
                    "--schedule", schedule_path, "--run-start", repr(run_start), "--deadline", repr(deadline),
                    "--hang-s", str(hang_s), "--timeout", str(hang_timeout)]
            args += ["--fix-dummy-work"] if fix_dummy_work else []
            _supervise(args, replicas, log_dir, deadline)
    finally:
        lighthouse.shutdown()


def _start(args, replica: int, log_dir: str) -> subprocess.Popen:
    """Start one replica's process, its output appended to log_dir/replica<r>.out."""
    with open(os.path.join(log_dir, f"replica{replica}.out"), "ab") as out:
        return subprocess.Popen([sys.executable, os.path.join(HERE, "torchft_worker.py"), "--replica", str(replica),
                                 *args], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _supervise(args, replicas: int, log_dir: str, deadline: float) -> None:
    """Keep every replica running until the deadline, restarting each dead one alone; then wait and clean up."""
    procs = {r: _start(args, r, log_dir) for r in range(replicas)}
    try:
        while procs and time.time() < deadline + GRACE_S:
            for r, p in list(procs.items()):
                if p.poll() is None:
                    continue
                if time.time() < deadline:
                    procs[r] = _start(args, r, log_dir)  # this replica alone; the others keep training
                else:
                    del procs[r]
            time.sleep(POLL_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
