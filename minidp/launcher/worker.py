"""Inside a launched worker: torchrun's variables, die with the launcher, report the error, exit cleanly.

The child side of `minidp.launch` and `python -m minidp.run`; the parent side (watching the workers,
stopping them all on the first failure) is supervisor.py. The two meet through an error file: a
worker that raises writes the time and its traceback there (write_error), and the supervisor reads
it (read_error) to tell which rank failed first and why.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback
from typing import Dict


def worker_env(local_rank, nprocs, nnodes, node_rank, master_addr, master_port) -> Dict[str, str]:
    """The variables torchrun sets for one worker.

    Args:
        local_rank: the worker's index on this node, in [0, nprocs).
        nprocs: workers per node.
        nnodes: number of nodes.
        node_rank: this node's index, in [0, nnodes).
        master_addr, master_port: where rank 0 hosts the rendezvous.
    """
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


def exit_now(code: int) -> None:
    """Run atexit handlers, flush, and leave without C++ static destructors.

    Why: with torch's gloo backend, a finished worker can abort at interpreter teardown
    ("terminate called without an active exception") when a gloo thread outlives the Python
    objects it refers to, even after destroy_process_group(); the work is done by then, so
    skipping the teardown loses nothing and keeps a clean exit status.

    Args:
        code: the process's exit status.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _after_fork() -> None:
    """Make a forked worker safe and light: drop the parent's exit handlers, freeze the parent's
    objects for the garbage collector, one torch thread.

    Why: the parent's atexit handlers (IPython's history database, its temp files) are not the
    worker's to run. The parent's objects stay alive in the worker, and the garbage collector would
    walk all of them in each full collection, writing to each one's header: a copy-on-write copy of
    every page that holds one, and seconds of work a collection when the parent holds millions (a test
    session, a notebook). gc.freeze() takes them out of its walks (CPython's advice for fork without
    exec); they are still freed by reference counting, only a cycle among them is never collected.
    And GNU OpenMP's thread pool does not survive a fork: once the parent has run a parallel torch op,
    the child's next one waits forever for threads that do not exist in it, unless the child uses one
    thread (as torch's DataLoader workers do; torchrun's default too). So a forked worker must not
    raise torch.set_num_threads() if this process has run parallel torch ops.
    """
    import atexit
    import gc

    atexit._clear()
    gc.freeze()  # O(1): moves every tracked object to the permanent generation
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _spawned_worker(local_rank, fn, args, env, error_path, forked=False):
    """The target of each process minidp.launch starts: run `fn(local_rank, *args)`, report, exit.

    Args:
        local_rank: passed to `fn` first.
        fn, args: the user's function and its extra arguments.
        env: torchrun's variables for this worker (worker_env).
        error_path: where to write the traceback if `fn` raises.
        forked: True when started by fork rather than spawn. Default False.
    """
    # Its own process group (so the parent can kill its whole tree), die with the parent,
    # torchrun's variables, then the user's function.
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
