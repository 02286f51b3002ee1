"""Start one process per local rank, in the style of mp.spawn, and watch them.

Each worker gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, ...), so
`minidp.init()` inside it needs no arguments. The parent watches the workers: when one fails, the
others are terminated (their whole process groups, so DataLoader workers go too), and the first
failure is reported with its rank and traceback. A worker also dies if the launcher dies
(PR_SET_PDEATHSIG on Linux), so no orphan is left behind.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from .validate import check_int, check_number

POLL_S = 0.05
GRACE_S = 3.0  # how long a terminated worker gets before SIGKILL


class WorkerFailed(RuntimeError):
    """A worker exited non-zero. `.rank` is the global rank that failed first."""

    def __init__(self, rank: int, exitcode: int, detail: str):
        self.rank, self.exitcode = rank, exitcode
        super().__init__(f"worker rank {rank} failed first (exit code {exitcode}).\n{detail}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_topology(nprocs, nnodes, node_rank, master_addr) -> None:
    """Validate the launch arguments shared by launch() and the CLI."""
    check_int("nprocs", nprocs, 1)
    check_int("nnodes", nnodes, 1)
    if not 0 <= check_int("node_rank", node_rank) < nnodes:
        raise ValueError(f"node_rank={node_rank} must be in [0, nnodes={nnodes})")
    if nnodes > 1 and not master_addr:
        raise ValueError(f"master_addr={master_addr!r} with nnodes={nnodes}: give the address of node 0")


def _check_launch_args(fn, args, master_port, timeout) -> None:
    if not callable(fn):
        raise TypeError(f"fn={fn!r} must be a callable fn(local_rank, *args) (for a script, use minidp.run)")
    if not isinstance(args, tuple):
        raise TypeError(f"args={args!r} must be a tuple of extra arguments for fn")
    if master_port is not None:
        check_int("master_port", master_port, 1, 65535)
    if timeout is not None:
        check_number("timeout", timeout, positive=True)  # seconds


def worker_env(local_rank, nprocs, nnodes, node_rank, master_addr, master_port) -> Dict[str, str]:
    """The variables torchrun sets for one worker."""
    return {
        "RANK": str(node_rank * nprocs + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nnodes * nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),  # torchrun's default too
    }


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies; a no-op elsewhere."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def write_error(path: str, exc_text: str) -> None:
    """Record a worker's traceback with the time it happened, so the parent can tell who failed first."""
    with open(path, "w") as f:
        f.write(f"{time.time()!r}\n{exc_text}")


def read_error(path: str):
    """(time, traceback) from write_error's file, or (inf, None) when the worker left none."""
    try:
        with open(path) as f:
            stamp, _, text = f.read().partition("\n")
        return float(stamp), text
    except (OSError, ValueError):
        return float("inf"), None


def _spawned_worker(local_rank, fn, args, env, error_path, forked=False):
    # Runs in the child: its own process group (so the parent can kill its whole tree), die with
    # the parent, torchrun's variables, then the user's function.
    if forked:
        _after_fork()
    os.setpgid(0, 0)
    die_with_parent()
    os.environ.update(env)
    try:
        fn(local_rank, *args)
    except BaseException:
        write_error(error_path, traceback.format_exc())
        exit_now(1)
    exit_now(0)


def _after_fork() -> None:
    """Make a forked worker safe: drop the parent's exit handlers, one torch thread.

    Why: the parent's atexit handlers (IPython's history database, its temp files) are not the
    worker's to run. And GNU OpenMP's thread pool does not survive a fork: once the parent has run a
    parallel torch op, the child's next one waits forever for threads that do not exist in it, unless
    the child uses one thread (as torch's DataLoader workers do; torchrun's default too). So a forked
    worker must not raise torch.set_num_threads() if this process has run parallel torch ops.
    """
    import atexit

    atexit._clear()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def exit_now(code: int) -> None:
    """Run atexit handlers, flush, and leave without C++ static destructors.

    Why: with torch's gloo backend, a finished worker can abort at interpreter teardown
    ("terminate called without an active exception") when a gloo thread outlives the Python
    objects it refers to, even after destroy_process_group(); the work is done by then, so
    skipping the teardown loses nothing and keeps a clean exit status.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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
    """Wait for all workers; on the first failure (or timeout) stop the rest and raise."""
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


def start_method(fn: Callable) -> str:
    """"spawn" when the children can import `__main__`, else "fork" (notebooks, `python -`, `python -c`).

    Why: spawn starts a fresh interpreter that re-imports the parent's `__main__` to find `fn`; that
    fails when `__main__` is not a file (`FileNotFoundError: '<stdin>'`, or no `fn` in the child).
    Fork needs no import, but a forked child cannot use CUDA once the parent has initialised it.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None) or (path and os.path.isfile(path)):
        return "spawn"  # `python script.py` or `python -m module`: the child imports it again
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return "fork"
    if path is None and getattr(fn, "__module__", "__main__") != "__main__":
        return "spawn"  # e.g. Jupyter with fn imported from a module: the child can import that
    raise RuntimeError(
        f"minidp.launch: __main__ is not a file ({path or 'a notebook or python -c'}) and CUDA is already "
        f"initialised in this process, so the workers can neither be spawned (they cannot import "
        f"{getattr(fn, '__qualname__', fn)!r} from __main__) nor forked (CUDA does not survive a fork). "
        "Either call launch() before anything touches CUDA (restart the kernel), or put fn in a .py "
        "module and import it from there, or run a script with python -m minidp.run.")


def launch(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: Optional[str] = "127.0.0.1",
    master_port: Optional[int] = None,
    timeout: Optional[float] = None,
) -> None:
    """Run `fn(local_rank, *args)` in `nprocs` new processes on this node, like mp.spawn.

    Global rank = node_rank * nprocs + local_rank. Call minidp.init() inside `fn`. Works from a
    script, a notebook, `python -` and `python -c` (see start_method: those fork instead of spawn).

    Args:
        fn: a picklable (module-level) function.
        nprocs: processes on this node (usually one per GPU).
        args: extra positional arguments for `fn`. Default ().
        nnodes: number of nodes. Default 1.
        node_rank: this node's index in [0, nnodes). Default 0.
        master_addr: address of node 0, where rank 0 hosts the rendezvous. Default "127.0.0.1".
        master_port: its port. Default: a free port on a single node; required with nnodes > 1.
        timeout: seconds after which the run is stopped with TimeoutError. Default: none.

    Raises:
        WorkerFailed: naming the first rank that failed, with its traceback. "First" is by the time
            the exception left `fn`: a rank that tears its process group down in a `finally` before
            that lets its peers fail earlier, so let the exception out first.

    Example:
        def train(local_rank):
            env = minidp.init()
            ...
        minidp.launch(train, nprocs=2)
    """
    check_topology(nprocs, nnodes, node_rank, master_addr)
    _check_launch_args(fn, args, master_port, timeout)
    if master_port is None:
        if nnodes > 1:
            raise ValueError(f"master_port=None with nnodes={nnodes}: every node must be given the same port")
        master_port = free_port(master_addr)
    method = start_method(fn)
    context = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory(prefix="minidp-launch-") as error_dir:
        workers = []
        try:
            for local_rank in range(nprocs):
                env = worker_env(local_rank, nprocs, nnodes, node_rank, master_addr, master_port)
                error_path = os.path.join(error_dir, f"rank{env['RANK']}.err")
                proc = context.Process(target=_spawned_worker, name=f"minidp-rank{env['RANK']}",
                                       args=(local_rank, fn, args, env, error_path, method == "fork"))
                proc.start()
                workers.append(Worker(int(env["RANK"]), proc, error_path))
        except BaseException:
            terminate(workers)
            raise
        supervise(workers, timeout)
