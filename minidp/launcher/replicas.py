"""`python -m minidp.run --ft`: a coordinator and one process per replica; a dead replica restarts alone.

    python -m minidp.run --ft --nproc-per-node 3 --max-restarts 10 train.py

The coordinator (`python -m minidp.ft.coordinator`, a process that does not train) holds the store;
each replica is a world of its own (RANK 0 of WORLD_SIZE 1, its own MASTER_PORT, so minidp.init()
works unchanged) and finds the coordinator in MINIDP_FT_COORDINATOR, its id in MINIDP_FT_REPLICA_ID.
When a replica's process dies, the others keep training (the coordinator leaves it out of the next
round) and the launcher starts it again, alone, up to --max-restarts times in the whole run; the new
process heals from a live peer. The run ends when every replica has exited; its status is 0 when
every replica still running at the end finished with 0.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .spawn import free_port
from .supervisor import POLL_S, Worker, _describe, terminate
from .worker import worker_env

_ERROR_FILE_VAR = "MINIDP_ERROR_FILE"


def run_replicas(a, script_code: str) -> int:
    """Start the coordinator and `a.nproc_per_node` replicas; restart dead ones; the exit status."""
    port = free_port(a.master_addr)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "minidp.ft.coordinator", "--host", a.master_addr, "--port", str(port),
         "--min-replicas", str(a.min_replicas), "--max-replicas", str(a.nproc_per_node),
         "--join-timeout", str(a.join_timeout)], start_new_session=True)
    replicas: dict[int, Worker] = {}
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="minidp-ft-") as error_dir:
        try:
            _wait_listening(a.master_addr, port, coordinator)
            for i in range(a.nproc_per_node):
                replicas[i] = _start(a, script_code, i, f"{a.master_addr}:{port}", error_dir, 0)
            finished: dict[int, int] = {}
            while len(finished) < len(replicas):
                time.sleep(POLL_S)
                if coordinator.poll() not in (None, 0):
                    print(f"minidp.run: the coordinator exited with {coordinator.returncode}", file=sys.stderr)
                    return 1
                for i, w in replicas.items():
                    code = w.exitcode()
                    if i in finished or code is None:
                        continue
                    if code == 0 or restarts >= a.max_restarts:
                        finished[i] = code
                        if code:
                            print(f"minidp.run: {_describe(w, code)}\nminidp.run: replica {i} is lost (no "
                                  f"restarts left of {a.max_restarts}); the others go on", file=sys.stderr)
                        continue
                    restarts += 1
                    print(f"minidp.run: {_describe(w, code).splitlines()[0]}\nminidp.run: restarting replica "
                          f"{i} alone (restart {restarts} of {a.max_restarts})", file=sys.stderr, flush=True)
                    replicas[i] = _start(a, script_code, i, f"{a.master_addr}:{port}", error_dir, restarts)
                if deadline is not None and time.monotonic() > deadline:
                    print(f"minidp.run: timeout={a.timeout}s passed", file=sys.stderr)
                    return 124
            # Replicas lost for good were lost along the way: the run finished if any replica did.
            return 0 if any(c == 0 for c in finished.values()) else 1
        except KeyboardInterrupt:
            return 130
        finally:
            terminate(list(replicas.values()))
            coordinator.send_signal(signal.SIGTERM)
            try:
                coordinator.wait(5)
            except subprocess.TimeoutExpired:
                coordinator.kill()


def _start(a, script_code, replica, coordinator, error_dir, attempt) -> Worker:
    env = worker_env(0, 1, 1, 0, a.master_addr, free_port(a.master_addr))
    error_path = os.path.join(error_dir, f"replica{replica}.{attempt}.err")
    env = {**os.environ, **env, _ERROR_FILE_VAR: error_path, "MINIDP_FT_COORDINATOR": coordinator,
           "MINIDP_FT_REPLICA_ID": str(replica), "TORCHELASTIC_RESTART_COUNT": str(attempt)}
    proc = subprocess.Popen([sys.executable, "-c", script_code, a.script, *a.script_args], env=env,
                            start_new_session=True)
    return Worker(replica, proc, error_path)


def _wait_listening(host, port, coordinator, timeout=60.0) -> None:
    """Return once the coordinator's store accepts connections (it imports torch first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if coordinator.poll() is not None:
            raise RuntimeError(f"the coordinator exited with {coordinator.returncode} before listening")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the coordinator did not listen on {host}:{port} within {timeout} s")
