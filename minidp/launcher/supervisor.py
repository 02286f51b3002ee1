"""Watch the worker processes of one node: on the first failure, stop them all and say who failed.

The parent side of `minidp.launch` and `python -m minidp.run` (the child side is worker.py). When a
worker fails, the others are terminated (their whole process groups, so DataLoader workers go too),
and the first failure is reported with its rank and traceback.
"""
from __future__ import annotations

import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from .worker import read_error

POLL_S = 0.05
GRACE_S = 3.0  # how long a terminated worker gets before SIGKILL


class WorkerFailed(RuntimeError):
    """A worker exited non-zero. `.rank` is the global rank that failed first."""

    def __init__(self, rank: int, exitcode: int, detail: str):
        self.rank, self.exitcode = rank, exitcode
        super().__init__(f"worker rank {rank} failed first (exit code {exitcode}).\n{detail}")


@dataclass
class Worker:
    """One watched child: a multiprocessing.Process or a subprocess.Popen, with its rank."""

    rank: int
    proc: object
    error_path: str

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exitcode(self) -> Optional[int]:
        proc = self.proc
        return proc.exitcode if hasattr(proc, "exitcode") else proc.poll()


def _describe(worker: Worker, code: int) -> str:
    _, text = read_error(worker.error_path)
    if text:
        return f"[rank {worker.rank}] {text.rstrip()}"
    if code < 0:
        return f"[rank {worker.rank}] killed by signal {signal.Signals(-code).name} (pid {worker.pid})"
    return f"[rank {worker.rank}] exited with code {code} (pid {worker.pid}); see its output above"


def terminate(workers: Sequence[Worker]) -> None:
    """SIGTERM every live worker's process group, then SIGKILL whatever is left after GRACE_S."""
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, GRACE_S)):
        alive = [w for w in workers if w.exitcode() is None]
        for w in alive:
            _signal_tree(w.pid, sig)
        deadline = time.monotonic() + wait_s
        while any(w.exitcode() is None for w in alive) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for w in workers:  # also take down grandchildren of workers that had already exited
        _signal_tree(w.pid, signal.SIGKILL)


def _signal_tree(pid: int, sig: int) -> None:
    """Signal the worker's process group; the worker alone if it has not made its group yet."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            continue


def supervise(workers: List[Worker], timeout: Optional[float] = None) -> None:
    """Wait for all workers; on the first failure (or timeout) stop the rest and raise.

    Args:
        workers: the started workers of this node.
        timeout: seconds after which the run is stopped with TimeoutError. Default None: none.

    Raises:
        WorkerFailed: naming the worker that failed first, with its traceback.
        TimeoutError: `timeout` passed with workers still running.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    exit_seen: Dict[int, float] = {}  # rank -> wall time the launcher saw the process end
    waiter = _ExitWaiter(workers)
    try:
        while True:
            waiter.wait(POLL_S)  # wakes as soon as any worker exits
            codes = [w.exitcode() for w in workers]
            for w, c in zip(workers, codes):
                if c is not None:
                    exit_seen.setdefault(w.rank, time.time())
            failed = [(w, c) for w, c in zip(workers, codes) if c not in (None, 0)]
            if failed:
                # A peer's death breaks the others' collectives, so several may have failed by now.
                # The cause is the earliest: its exception's time, or its exit for a killed worker.
                def failed_at(wc):
                    return min(read_error(wc[0].error_path)[0], exit_seen[wc[0].rank])
                worker, code = min(failed, key=failed_at)
                raise WorkerFailed(worker.rank, code, _describe(worker, code))
            if all(c == 0 for c in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                running = [w.rank for w, c in zip(workers, codes) if c is None]
                raise TimeoutError(f"launch: timeout={timeout}s passed with ranks {running} still running")
    finally:
        waiter.close()
        terminate(workers)


class _ExitWaiter:
    """Block until some worker exits (pidfd + select on Linux), or for at most the poll interval."""

    def __init__(self, workers):
        self.fds = {}  # pidfd -> worker, for workers still running
        for w in workers:
            try:
                self.fds[os.pidfd_open(w.pid)] = w
            except (AttributeError, OSError):  # not Linux >= 5.3: fall back to polling
                self.close()
                return

    def wait(self, seconds: float) -> None:
        if not self.fds:
            time.sleep(seconds)
            return
        readable, _, _ = select.select(list(self.fds), [], [], seconds)
        for fd in readable:  # an exited worker's pidfd stays readable: stop watching it
            os.close(fd)
            del self.fds[fd]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = {}
