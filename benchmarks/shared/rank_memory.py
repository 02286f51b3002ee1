"""What the memory benchmarks (memory/zero.py, memory/fully_shard.py) count inside a rank, and how they launch.

Bytes are counted from tensors, each storage once (by its data pointer; a DTensor by its local tensor),
so views and tied tensors are not counted twice and a storage resized to 0 (FSDP's freed gathered
weights) counts 0. The process's figures are RSS from /proc/self/status (peak: shared/memory.py).
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import minidp


def build_model(width: int, layers: int) -> nn.Module:
    """`layers` x (Linear(width, width), Tanh), seeded: the same weights on every rank and engine."""
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, or `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages of `tensors` not yet in `seen` (data pointers; updated). None skipped."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_bytes(local_opt) -> dict:
    """Bytes of the tensors in the local optimizer's state, each storage once: moments and `step`s."""
    seen, out = set(), {"moments": 0, "step": 0, "tensors": 0}
    for param_state in local_opt.state.values():
        for key, value in param_state.items():
            if not torch.is_tensor(value):
                continue
            size = storage_bytes([value], seen)
            out["step" if key == "step" else "moments"] += size
            out["tensors"] += 1 if size else 0
    out["params_held"] = sum(p.numel() for p in local_opt.state)
    out["param_tensors_held"] = len(local_opt.state)
    return out


def rss_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def launch_json(fn, nprocs: int, args: tuple):
    """Run fn(local_rank, *args, out_path) in `nprocs` forked ranks; what rank 0 wrote to out_path."""
    with tempfile.TemporaryDirectory(prefix="minidp-memory-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        minidp.launch(fn, nprocs=nprocs, args=(*args, out_path), start_method="fork")
        with open(out_path) as f:
            return json.load(f)


def alternate_every_step(engines: dict, step, x, y, steps: int, warmup: int) -> dict:
    """{key: median ms} of step(model, opt, x, y) for each (model, opt) in `engines`, the engines taking
    turns every step (warm-up steps not timed); a barrier before each, so ranks start it together."""
    times = {key: [] for key in engines}
    for i in range(warmup + steps):
        for key, (model, opt) in engines.items():  # alternate every step
            dist.barrier()  # ranks meet here: each timed step starts together
            start = time.perf_counter()
            step(model, opt, x, y)
            if i >= warmup:
                times[key].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(t) for key, t in times.items()}
