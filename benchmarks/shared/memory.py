"""Peak memory of one engine, measured in processes of its own.

Why separate processes: the timing runs hold both engines in one process, and a process's peak RSS
(ru_maxrss) only ever grows, so it cannot say which engine caused it. Here each (workload, setting,
engine) gets fresh worker processes that do, in order:

  1. build the model, the batch and the optimizer, and run plain (unwrapped) training steps:
     the *baseline* peak is everything the model itself needs (weights, grads, optimizer state,
     activations);
  2. wrap the same model in the engine and run warm-up plus timed-length steps: the *peak*.

The engine's *extra* memory = peak - baseline: its bucket buffers, any gradient copies, and
transients of its step. On CPU the figure is the peak RSS of the process (VmHWM, in MiB; not
ru_maxrss, which on Linux carries over the parent's peak through fork+exec); on GPU it is
torch.cuda.max_memory_allocated (RSS would hide the caching allocator's work).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import measure
import workloads


def peak_mib(device: torch.device) -> float:
    """This process's peak memory so far: max allocated on GPU, peak RSS (VmHWM) on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError("memory: /proc/self/status has no VmHWM line (Linux only)")


def run_memory_job(job: dict, rank: int, device: torch.device) -> dict:
    """Baseline peak, then peak with `job['engine']` wrapped around the same model."""
    load = workloads.get(job["workload"], job["quick"])
    model = load.build(seed=0).to(device)
    x, y = load.batch_for(rank, device)
    opt = workloads.make_optimizer(model)
    for _ in range(3):
        workloads.train_step(model, opt, x, y)
    baseline = peak_mib(device)
    wrapped = measure.ENGINES[job["engine"]](model, **measure.engine_kwargs(job, device))
    for _ in range(job["steps"]):
        workloads.train_step(wrapped, opt, x, y)
    peak = peak_mib(device)
    return {"job": job, "world_size": dist.get_world_size(), "baseline_mib": baseline, "peak_mib": peak,
            "extra_mib": peak - baseline}
