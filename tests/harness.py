"""Test harness: run a function on N real gloo processes (CPU) and collect what each returns.

Built on minidp.launch, so a failing rank re-raises here as WorkerFailed with its traceback, a hung
run ends with TimeoutError, and no worker outlives the test. Also the small helpers several test
files share: error_of() (an error as a value, so one process can try many cases), write_pid() /
assert_dead() (no process outlives a failure), done() and Loopback (a finished future, a one-rank
transport), and sizes_and_keys() (what the bucket planner reads of a list of tensors).

Workers are forked from the pytest process where that is safe (see worker_start_method): a spawned
worker spends ~4 s of CPU importing torch, and ~3 s more in its first torch DDP constructor (which
imports torch._dynamo); a forked one inherits both, so a 2-rank run starts in a fraction of a second
instead of ~6 s on this 2-core machine. Where forking is not safe (this process runs threads), they
come from multiprocessing's fork server instead: a clean single-threaded process, started once, that
imported torch, torch._dynamo and minidp and forks each worker from itself. MINIDP_TEST_SPAWN=1 in the
environment spawns them always.
"""
from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import random
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import minidp
from minidp import comm

_launch_module = importlib.import_module("minidp.launcher.spawn")  # the module of minidp.launch
_IMPORTED_BY = os.getpid()
_LAUNCH_VARS = tuple(_launch_module.worker_env(0, 1, 1, 0, "127.0.0.1", 1))  # what launch() sets in a worker
# What the fork server imports once, before it forks any worker (it starts at its first use).
multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch._dynamo", "minidp", "harness"])
# This process's threads before any test ran (the main thread, numpy's OpenBLAS pool).
_THREADS_AT_IMPORT = frozenset(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else frozenset()


def no_new_threads() -> bool:
    """True if this process runs no thread started since the harness was imported, or only one thread.

    (Linux: /proc/self/task. A forked worker has one thread, its own, whatever its parent ran.)
    """
    try:
        threads = set(os.listdir("/proc/self/task"))
    except OSError:
        return False
    return len(threads) == 1 or (bool(_THREADS_AT_IMPORT) and threads <= _THREADS_AT_IMPORT)


def worker_start_method() -> str:
    """"fork" where it is safe, else "spawn"; decided when the workers start.

    Fork only when no thread has been started in this process since the harness was imported: a
    thread running at the fork (gloo's, a compression worker's, a background reader's) may hold a
    lock that no thread of the child will ever release, and the child hangs on it. Never after CUDA
    is available (a process that has touched CUDA cannot fork workers that use it, and on a CUDA
    machine tests/conftest.py hides the GPUs from CPU tests' children through an environment variable
    that a forked child would not read), nor with a process group initialised here (every worker
    would inherit it).
    """
    if os.environ.get("MINIDP_TEST_SPAWN") or torch.cuda.is_available() or dist.is_initialized():
        return "spawn"
    return "fork" if no_new_threads() else "spawn"


START_METHODS: dict[str, int] = {"fork": 0, "forkserver": 0, "spawn": 0}  # launches so far (conftest reports)
NOT_FORKED_IN: list[str] = []  # "<method> in <test>" where the workers were not forked (each a saving lost)


def _pick_start_method(fn) -> str:
    method = worker_start_method()
    if method == "spawn" and fn is _entry and not os.environ.get("MINIDP_TEST_SPAWN") and not torch.cuda.is_available():
        method = "forkserver"  # run_ranks' workers: _entry brings this process's environment along
    START_METHODS[method] += 1
    if method != "fork":
        NOT_FORKED_IN.append(f"{method} in {os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}")
    if method == "fork":  # torch DDP's constructor imports torch._dynamo (~3 s): once here, not in every worker
        importlib.import_module("torch._dynamo")
    return method


@contextlib.contextmanager
def workers_forked():
    """Inside the block, minidp.launch forks its workers where worker_start_method() allows.

    minidp.launch itself picks spawn under pytest (its __main__ is a file): the choice is made here,
    each time launch() starts workers.
    """
    with mock.patch.object(_launch_module, "start_method", _pick_start_method):
        yield


def _entry(local_rank, fn, args, out_dir, init_kwargs, environ):
    torch.set_num_threads(1)  # 2 cores on this machine: one thread per rank
    # The test's environment, as at the launch, with the launch's variables (RANK, MASTER_PORT, ...): a
    # worker from the fork server would otherwise keep the one the server started with.
    launch_vars = {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ}
    os.environ.clear()
    os.environ.update(environ, **launch_vars)
    if _IMPORTED_BY != os.getpid():
        # Forked (a spawned worker imported this module itself): draw as a fresh process would, every
        # rank its own unseeded state, not a copy of the parent's.
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
    if init_kwargs is not None:
        minidp.init(**init_kwargs)
    # No try/finally around shutdown: on an error, shutting down first would break the peers'
    # collectives before this rank records its traceback, and the launcher would blame a peer.
    result = fn(*args)
    minidp.shutdown()
    torch.save(result, os.path.join(out_dir, f"{os.environ['RANK']}.pt"))


def run_ranks(fn, world_size, *args, timeout=120.0, init=True, collective_timeout=60.0):
    """Run `fn(*args)` on `world_size` processes after minidp.init(); return the results by rank.

    `fn` must be a module-level function. With init=False, fn runs without a process group.
    """
    init_kwargs = {"timeout": collective_timeout} if init else None
    with tempfile.TemporaryDirectory(prefix="minidp-test-") as out_dir, workers_forked():
        minidp.launch(_entry, world_size, args=(fn, args, out_dir, init_kwargs, dict(os.environ)), timeout=timeout)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


# What error_of() turns into a value: the types minidp.DDP and torch DDP raise for bad arguments, bad hooks
# and bad state (ValueError, TypeError, RuntimeError and its subclasses such as NotImplementedError), and
# AssertionError, which torch DDP's legacy gather() raises for CPU tensors (minidp.DDP raises what torch
# does, and test_drop_in compares the two). Anything else propagates: a bug in a worker (a KeyError, an
# AttributeError) fails the run with its traceback instead of becoming a value a test might compare equal.
ERRORS_AS_VALUES = (RuntimeError, ValueError, TypeError, AssertionError)


def error_of(fn, *args, **kwargs):
    """(exception type name, message) of what fn(*args, **kwargs) raises, or None if it returns.

    An error as a value: one worker tries many cases in one launch and returns what each raised, as
    plain values the parent checks. Catches ERRORS_AS_VALUES only; keep the test's own asserts out of `fn`.
    """
    try:
        fn(*args, **kwargs)
    except ERRORS_AS_VALUES as exc:
        return type(exc).__name__, str(exc)
    return None


def write_pid(folder, rank):
    """Record this process's pid as folder/<rank>.pid, for assert_dead()."""
    with open(os.path.join(folder, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def assert_dead(folder, world_size):
    """Every rank's recorded process is gone (signal 0 probes a pid without sending anything)."""
    for rank in range(world_size):
        with open(os.path.join(folder, f"{rank}.pid")) as f:
            pid = int(f.read())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def done(value):
    """A torch Future that already holds `value`: what a hook or transport returns with nothing to wait for."""
    future = torch.futures.Future()
    future.set_result(value)
    return future


class Loopback(comm.Transport):
    """A transport for one rank, with no process group: every collective is the identity.

    Each collective hands its result to _done(), which a subclass may override (test_gpu_streams makes a
    slow peer of it by sleeping on the GPU first).
    """

    rank, world_size = 0, 1

    def check_device(self, device):
        pass

    def _done(self, tensor):
        return done(tensor)

    def all_reduce(self, tensor):
        return self._done(tensor)

    def all_gather(self, output, input):
        return self._done(output.copy_(input.view_as(output)))

    def all_to_all(self, output, input):
        return self._done(output.copy_(input))


def sizes_and_keys(tensors):
    """What the bucket planner (minidp.engine.planning) reads of each tensor: its size in bytes, and the
    (dtype, device) that decides which tensors may share a bucket."""
    return [t.numel() * t.element_size() for t in tensors], [(t.dtype, t.device) for t in tensors]
