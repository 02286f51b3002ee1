"""Start one process per local rank, in the style of mp.spawn, and watch them.

Each worker gets the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, ...), so
`minidp.init()` inside it needs no arguments. The parent watches the workers: when one fails, the
others are terminated (their whole process groups, so DataLoader workers go too), and the first
failure is reported with its rank and traceback. A worker also dies if the launcher dies
(PR_SET_PDEATHSIG on Linux), so no orphan is left behind.

This module holds the entry point and its checks; what runs inside each worker is worker.py, and
the watching is supervisor.py (their names are re-exported here, where they used to live).
"""
from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
from typing import Callable, Optional

from ..validate import check_int, check_number
from .supervisor import GRACE_S, POLL_S, Worker, WorkerFailed, supervise, terminate
from .worker import _spawned_worker, die_with_parent, exit_now, read_error, worker_env, write_error

__all__ = [
    "GRACE_S", "POLL_S", "START_METHODS", "Worker", "WorkerFailed", "check_topology", "chosen_start_method",
    "die_with_parent", "exit_now", "free_port", "launch", "read_error", "start_method", "supervise", "terminate",
    "worker_env", "write_error",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it).

    Args:
        host: the address to bind on. Default "127.0.0.1".
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_topology(nprocs, nnodes, node_rank, master_addr) -> None:
    """Validate the launch arguments shared by launch() and the CLI (see launch() for their meaning)."""
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


def _main_importable() -> bool:
    """Whether a spawned child can import the parent's `__main__` again (a script or `python -m`)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return bool(getattr(getattr(main, "__spec__", None), "name", None) or (path and os.path.isfile(path)))


def _cuda_initialised() -> bool:
    """Whether this process has initialised CUDA (a forked child could not use it then); no torch import."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def start_method(fn: Callable) -> str:
    """"spawn" when the children can import `__main__`, else "fork" (notebooks, `python -`, `python -c`).

    Why: spawn starts a fresh interpreter that re-imports the parent's `__main__` to find `fn`; that
    fails when `__main__` is not a file (`FileNotFoundError: '<stdin>'`, or no `fn` in the child).
    Fork needs no import, but a forked child cannot use CUDA once the parent has initialised it.
    """
    if _main_importable():
        return "spawn"  # `python script.py` or `python -m module`: the child imports it again
    if not _cuda_initialised():
        return "fork"
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None and getattr(fn, "__module__", "__main__") != "__main__":
        return "spawn"  # e.g. Jupyter with fn imported from a module: the child can import that
    raise RuntimeError(
        f"minidp.launch: __main__ is not a file ({path or 'a notebook or python -c'}) and CUDA is already "
        f"initialised in this process, so the workers can neither be spawned (they cannot import "
        f"{getattr(fn, '__qualname__', fn)!r} from __main__) nor forked (CUDA does not survive a fork). "
        "Either call launch() before anything touches CUDA (restart the kernel), or put fn in a .py "
        "module and import it from there, or run a script with python -m minidp.run.")


START_METHODS = ("spawn", "fork", "forkserver")


def chosen_start_method(fn: Callable, requested: Optional[str]) -> str:
    """The start method launch() uses: `requested`, else $MINIDP_START_METHOD, else start_method(fn).

    An explicit "fork" is refused once this process has initialised CUDA (the children could not use
    it); where it is allowed it saves each worker its imports (torch: seconds of CPU per process).
    """
    where = "start_method" if requested is not None else "MINIDP_START_METHOD"
    requested = requested if requested is not None else (os.environ.get("MINIDP_START_METHOD") or None)
    if requested is None:
        return start_method(fn)
    if requested not in START_METHODS:
        raise ValueError(f"{where}={requested!r} must be one of {', '.join(START_METHODS)}")
    if requested != "fork" and getattr(fn, "__module__", None) == "__main__" and not _main_importable():
        raise ValueError(f"{where}={requested!r}: {getattr(fn, '__qualname__', fn)!r} is defined in a __main__ "
                         "that is not a file (a notebook, python - or -c), so a new interpreter cannot import it; "
                         "use 'fork', or put fn in a .py module")
    if requested == "fork" and _cuda_initialised():
        raise RuntimeError(f"{where}='fork': CUDA is already initialised in this process, and a forked worker "
                           "cannot use it; use 'spawn' (the default for a script) or launch before touching CUDA")
    return requested


def launch(
    fn: Callable,
    nprocs: int,
    args: tuple = (),
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: Optional[str] = "127.0.0.1",
    master_port: Optional[int] = None,
    timeout: Optional[float] = None,
    start_method: Optional[str] = None,
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
        start_method: "spawn", "fork" or "forkserver", as torch.multiprocessing.start_processes takes.
            Default: $MINIDP_START_METHOD if set, else "spawn" from a script and "fork" where the
            children could not import `__main__` (see start_method()). "fork" starts a worker in a
            fraction of a second instead of seconds of imports; it needs a parent that has not
            touched CUDA, and the workers inherit the parent's state.

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
    method = chosen_start_method(fn, start_method)
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
