"""Test harness: run a function on N real gloo processes (CPU) and collect what each returns.

Built on minidp.launch, so a failing rank re-raises here as WorkerFailed with its traceback, a hung
run ends with TimeoutError, and no worker outlives the test.
"""
from __future__ import annotations

import os
import tempfile

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
