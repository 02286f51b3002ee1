"""Test harness: run a function on N real gloo processes (CPU) and collect what each returns.

Built on minidp.launch, so a failing rank re-raises here as WorkerFailed with its traceback, a hung
run ends with TimeoutError, and no worker outlives the test. Also the small helpers several test
files share: error_of() (an error as a value, so one process can try many cases), and write_pid() /
assert_dead() (no process outlives a failure).
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import minidp


def _entry(local_rank, fn, args, out_dir, init_kwargs):
    torch.set_num_threads(1)  # 2 cores on this machine: one thread per rank
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
    with tempfile.TemporaryDirectory(prefix="minidp-test-") as out_dir:
        minidp.launch(_entry, world_size, args=(fn, args, out_dir, init_kwargs), timeout=timeout)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def error_of(fn):
    """(exception type name, message) of what fn() raises, or None: lets one worker try many cases."""
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
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
