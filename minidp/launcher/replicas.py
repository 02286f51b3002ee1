"""`python -m minidp.run --ft`: a coordinator and one process per replica; a dead replica restarts alone.

    python -m minidp.run --ft --nproc-per-node 3 --max-restarts 10 train.py

The coordinator (`python -m minidp.ft.coordinator`, a process that does not train) holds the store;
each replica is a world of its own (RANK 0 of WORLD_SIZE 1, its own MASTER_PORT, so minidp.init()
works unchanged) and finds the coordinator in MINIDP_FT_COORDINATOR, its id in MINIDP_FT_REPLICA_ID.
When a replica's process dies, the others keep training (the coordinator leaves it out of the next
round) and the launcher starts it again, alone, up to --max-restarts times in the whole run; the new
process heals from a live peer. A restart takes a *warm spare*: a process started beforehand that has
already imported torch and minidp (seconds of CPU) and waits for its replica's settings, so the new
replica asks for its round in a fraction of a second; a new spare then warms up in its place.
The run ends when every replica has exited, or when the coordinator does (0: the replicas have left,
or the run's newest state was lost with the last replicas holding it: 1); after the coordinator's
end nothing is restarted.
"""
from __future__ import annotations

import json
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
# A spare imports what every replica imports, then waits for one line: its settings (JSON), then runs.
_SPARE = ("import sys, json, os; import torch, torch.distributed, minidp.ft.replica; "
          "from minidp.launcher.cli import _run_script_as_worker as r; "
          "line = sys.stdin.readline(); "
          "line or sys.exit(0); os.environ.update(json.loads(line)); r(sys.argv[1], sys.argv[2:])")


def run_replicas(a) -> int:
    """Start the coordinator and `a.nproc_per_node` replicas; restart dead ones; the exit status."""
    port = free_port(a.master_addr)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "minidp.ft.coordinator", "--host", a.master_addr, "--port", str(port),
         "--min-replicas", str(a.min_replicas), "--max-replicas", str(a.nproc_per_node),
         "--join-timeout", str(a.join_timeout)], start_new_session=True)
    address = f"{a.master_addr}:{port}"
    replicas: dict[int, Worker] = {}
    spare = None
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    restarts = 0
    with tempfile.TemporaryDirectory(prefix="minidp-ft-") as error_dir:
        try:
            _wait_listening(a.master_addr, port, coordinator)
            for i in range(a.nproc_per_node):
                replicas[i] = _start(_cold(a), a, i, address, error_dir, 0)
            spare = _cold(a) if a.max_restarts else None
            finished: dict[int, int] = {}
            while len(finished) < len(replicas):
                time.sleep(POLL_S)
                ended = coordinator.poll()
                if ended not in (None, 0):
                    print(f"minidp.run: the coordinator exited with {ended}", file=sys.stderr)
                    return 1
                for i, w in replicas.items():
                    code = w.exitcode()
                    if i in finished or code is None:
                        continue
                    if code == 0 or restarts >= a.max_restarts or ended is not None:
                        finished[i] = code
                        if code:
                            why = "the run has ended" if ended is not None else f"no restarts left of {a.max_restarts}"
                            print(f"minidp.run: {_describe(w, code)}\nminidp.run: replica {i} is lost ({why})",
                                  file=sys.stderr)
                        continue
                    restarts += 1
                    print(f"minidp.run: {_describe(w, code).splitlines()[0]}\nminidp.run: restarting replica "
                          f"{i} alone (restart {restarts} of {a.max_restarts})", file=sys.stderr, flush=True)
                    replicas[i] = _start(spare, a, i, address, error_dir, restarts)
                    spare = _cold(a) if restarts < a.max_restarts else None
                if deadline is not None and time.monotonic() > deadline:
                    print(f"minidp.run: timeout={a.timeout}s passed", file=sys.stderr)
                    return 124
            # Replicas lost for good were lost along the way: the run finished if any replica did.
            return 0 if any(c == 0 for c in finished.values()) else 1
        except KeyboardInterrupt:
            return 130
        finally:
            if spare is not None:
                spare.kill()
            terminate(list(replicas.values()))
            coordinator.send_signal(signal.SIGTERM)
            try:
                coordinator.wait(5)
            except subprocess.TimeoutExpired:
                coordinator.kill()


def _cold(a) -> subprocess.Popen:
    """A process that imports torch and minidp now, then waits on stdin for its replica's settings."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.Popen([sys.executable, "-c", _SPARE, a.script, *a.script_args], env=env,
                            stdin=subprocess.PIPE, text=True, start_new_session=True)


def _start(process: subprocess.Popen, a, replica, coordinator, error_dir, attempt) -> Worker:
    """Hand a started (or warm) process its replica's settings: it runs the script as that replica."""
    env = worker_env(0, 1, 1, 0, a.master_addr, free_port(a.master_addr))
    error_path = os.path.join(error_dir, f"replica{replica}.{attempt}.err")
    env.update({_ERROR_FILE_VAR: error_path, "MINIDP_FT_COORDINATOR": coordinator,
                "MINIDP_FT_REPLICA_ID": str(replica), "TORCHELASTIC_RESTART_COUNT": str(attempt)})
    process.stdin.write(json.dumps(env) + "\n")
    process.stdin.close()
    return Worker(replica, process, error_path)


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
