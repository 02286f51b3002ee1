"""`python -m minidp.run`: run a script once per local rank with torchrun's environment.

    python -m minidp.run --nproc-per-node 2 train.py --epochs 3
    python -m minidp.run --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py      # on node 0; node-rank 1 on node 1

A script that works under torchrun works here unchanged, and the other way round.

With --max-restarts N, a worker's failure stops every worker of this node and starts them all again,
up to N times, as torchrun's elastic agent does; the workers see the attempt in
TORCHELASTIC_RESTART_COUNT (0 first) and resume from their checkpoint. After N restarts the run
gives up with the first failure's report.
"""
from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from typing import List, Optional

from .replicas import run_replicas
from .spawn import check_topology, free_port
from .supervisor import Worker, WorkerFailed, supervise, terminate
from .worker import die_with_parent, exit_now, worker_env, write_error

_ERROR_FILE_VAR = "MINIDP_ERROR_FILE"


def _run_script_as_worker(script: str, script_args: List[str]) -> None:
    """Child side: run the user's script as __main__, and record its traceback if it raises."""
    die_with_parent()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code in (None, 0):
            exit_now(0)
        code = exc.code if isinstance(exc.code, int) else 1
        write_error(os.environ[_ERROR_FILE_VAR], f"SystemExit({exc.code!r})\n")
        exit_now(code)
    except BaseException:
        write_error(os.environ[_ERROR_FILE_VAR], traceback.format_exc())
        exit_now(1)
    exit_now(0)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, torchrun's flags (both spellings) then the script and its arguments.

    Args:
        argv: the arguments after `python -m minidp.run`. Default None: sys.argv[1:].
    """
    p = argparse.ArgumentParser(prog="python -m minidp.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0 (default 127.0.0.1 on a single node)")
    p.add_argument("--master-port", "--master_port", type=int, default=None,
                   help="rendezvous port (default: a free one on a single node)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="on a worker's failure, restart all workers up to this many times (default 0)")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument("--ft", action="store_true",
                   help="fault-tolerant replicas (minidp.ft): a coordinator, one process per replica, a dead "
                        "replica restarted alone and healed from a live peer")
    p.add_argument("--min-replicas", "--min_replicas", type=int, default=1,
                   help="with --ft: the fewest replicas a round trains with (default 1)")
    p.add_argument("--join-timeout", "--join_timeout", type=float, default=5.0,
                   help="with --ft: seconds a round waits for a silent replica before leaving it out (default 5)")
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    return p.parse_args(argv)


def _start_scripts(a: argparse.Namespace, error_dir: str, workers: List[Worker], attempt: int = 0) -> None:
    """Start the script once per local rank, appending each to `workers` as it starts.

    Args:
        a: the parsed command line.
        error_dir: where each worker's error file goes (one folder per attempt).
        workers: the list to append to.
        attempt: the restart count, 0 first (TORCHELASTIC_RESTART_COUNT, as torchrun sets it). Default 0.
    """
    code = "from minidp.launcher.cli import _run_script_as_worker as r; import sys; r(sys.argv[1], sys.argv[2:])"
    for local_rank in range(a.nproc_per_node):
        env = worker_env(local_rank, a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr, a.master_port)
        error_path = os.path.join(error_dir, f"rank{env['RANK']}.err")
        env = {**os.environ, **env, _ERROR_FILE_VAR: error_path, "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts)}
        # Own session: the launcher can signal the worker's whole tree, and Ctrl-C reaches
        # only the launcher, which then stops every worker.
        proc = subprocess.Popen([sys.executable, "-c", code, a.script, *a.script_args], env=env,
                                start_new_session=True)
        workers.append(Worker(int(env["RANK"]), proc, error_path))


def main(argv: Optional[List[str]] = None) -> int:
    """Run the script on every local rank and wait; the exit status: 0, 1 (a rank failed), 124, 130.

    Args:
        argv: as for parse_args. Default None: sys.argv[1:].

    Raises:
        ValueError, TypeError: bad arguments (the __main__ block prints them and exits with 2).
    """
    a = parse_args(argv)
    if a.nnodes == 1 and a.master_addr is None:
        a.master_addr = "127.0.0.1"
    check_topology(a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr)
    if a.master_port is None:
        if a.nnodes > 1:
            raise ValueError(f"--master-port is required with --nnodes {a.nnodes}")
        a.master_port = free_port(a.master_addr)
    if not os.path.isfile(a.script):
        raise ValueError(f"script={a.script!r} is not a file")
    if a.max_restarts < 0:
        raise ValueError(f"--max-restarts {a.max_restarts} must be >= 0")
    if a.ft:
        return _run_ft(a)
    return _run_attempts(a)


def _run_ft(a: argparse.Namespace) -> int:
    """--ft: the replicas' launcher (replicas.py), after its own checks."""
    if a.nnodes != 1:
        raise ValueError(f"--ft with --nnodes {a.nnodes}: run one `python -m minidp.ft.coordinator` and a "
                         "launcher per replica group (see the README's fault-tolerance section)")
    if not 1 <= a.min_replicas <= a.nproc_per_node:
        raise ValueError(f"--min-replicas {a.min_replicas} must be between 1 and --nproc-per-node "
                         f"{a.nproc_per_node} (the replicas there are)")
    if a.join_timeout <= 0:
        raise ValueError(f"--join-timeout {a.join_timeout} must be > 0")
    return run_replicas(a)


def _run_attempts(a: argparse.Namespace) -> int:
    """Run the workers, restarting them all after a failure while restarts are left; the exit status."""
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    first_failure = None
    for attempt in range(a.max_restarts + 1):
        with tempfile.TemporaryDirectory(prefix="minidp-run-") as error_dir:
            workers: List[Worker] = []
            try:
                _start_scripts(a, error_dir, workers, attempt)
                supervise(workers, None if deadline is None else max(deadline - time.monotonic(), 0.0))
                return 0
            except WorkerFailed as exc:
                first_failure = first_failure or exc
                left = a.max_restarts - attempt
                print(f"minidp.run: {exc}" + (f"\nminidp.run: restarting all {a.nproc_per_node} worker(s) "
                      f"(restart {attempt + 1} of {a.max_restarts})" if left else ""), file=sys.stderr, flush=True)
            except TimeoutError as exc:
                print(f"minidp.run: {exc}", file=sys.stderr, flush=True)
                return 124
            except KeyboardInterrupt:
                return 130
            finally:
                terminate(workers)  # every worker of this attempt is gone before the next starts
    if a.max_restarts:
        print(f"minidp.run: giving up after {a.max_restarts} restart(s); the first failure was:\n"
              f"{first_failure}", file=sys.stderr, flush=True)
    return 1


def run_main() -> None:
    """`python -m minidp.run`'s entry: main(), with a bad argument as one line and exit status 2."""
    try:
        sys.exit(main())
    except (ValueError, TypeError) as exc:
        print(f"minidp.run: error: {exc}", file=sys.stderr)
        sys.exit(2)
