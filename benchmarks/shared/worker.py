"""Run a list of benchmark jobs on `world_size` fresh processes and bring rank 0's results back.

The parent calls `run_jobs(...)`; minidp.launch starts the workers (a failing rank re-raises here
with its traceback), each worker initialises the process group, runs every job in the same order
as its peers, and rank 0 writes the results as JSON.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

import minidp

# The workers import the benchmark modules by name, as the scripts do.
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def pick_device(device_kind: str, env) -> torch.device:
    """cpu, or this rank's GPU (several ranks may share one GPU under gloo)."""
    if device_kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch.cuda.is_available() is False on this machine")
    return torch.device("cuda", env.local_rank % torch.cuda.device_count())


def _entry(local_rank, jobs, out_path, backend, device_kind, threads, verbose):
    import measure  # noqa: I001 - imported here: the spawned child has set up sys.path by now
    import memory

    torch.set_num_threads(threads)  # one thread per rank by default: 2 cores on this machine
    env = minidp.init(backend=backend)
    device = pick_device(device_kind, env)
    results = []
    for job in jobs:
        run = {"memory": memory.run_memory_job, "timeline": measure.record_timeline,
               "autotune": measure.run_autotune_job}.get(job["kind"], measure.run_job)
        results.append(run(job, env.rank, device))
        if verbose and env.rank == 0:
            print(f"  done: {describe(job)}", flush=True)
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    minidp.shutdown()


def describe(job: dict) -> str:
    """A short label for progress lines."""
    cap = "default" if job["bucket_cap_mb"] is None else job["bucket_cap_mb"]
    extra = f" engine={job['engine']}" if "engine" in job else ""
    return f"{job['kind']} {job['workload']} cap={cap} gbv={job['gbv']}{extra}"


def run_jobs(jobs: list[dict], world_size: int, backend: str, device_kind: str, threads: int = 1,
             timeout: float = 1800.0, verbose: bool = True) -> list[dict]:
    """Run `jobs` in order on `world_size` new processes; returns rank 0's result per job."""
    with tempfile.TemporaryDirectory(prefix="minidp-bench-") as tmp:
        out_path = os.path.join(tmp, "results.json")
        minidp.launch(_entry, world_size, args=(jobs, out_path, backend, device_kind, threads, verbose),
                      timeout=timeout)
        with open(out_path) as f:
            return json.load(f)


def launch_for_json(entry, world_size: int, args: tuple = (), timeout: float = 3600.0):
    """Run `entry(local_rank, *args, out_path)` on `world_size` new processes; return what rank 0 saved.

    `entry` ends with `save_and_shut_down(result, rank, out_path)`.
    """
    with tempfile.TemporaryDirectory(prefix="minidp-bench-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        minidp.launch(entry, world_size, args=(*args, out_path), timeout=timeout)
        with open(out_path) as f:
            return json.load(f)


def save_and_shut_down(result, rank: int, out_path: str) -> None:
    """Rank 0 writes `result` as JSON to `out_path`; every rank leaves the process group."""
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    minidp.shutdown()
