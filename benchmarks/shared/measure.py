"""What each worker process measures: both engines side by side, alternating, in the same process.

One job = one workload with one setting (world size, bucket_cap_mb, gradient_as_bucket_view).
Every rank runs the same sequence, so the collectives match; rank 0 keeps the numbers:

  1. construction: each engine's constructor on a fresh copy of the model, alternating, N times;
  2. warm-up: a few steps of every phase (DDP and minidp rebuild their buckets after the first);
  3. rounds: every phase runs K timed steps per round, in the order A B C ... and then reversed
     (... C B A) on the next round, so that drift of the machine (other jobs on the same cores)
     hits every phase alike. Phases: "minidp", "ddp" (synced steps); with limits also
     "minidp_nosync", "ddp_nosync" (the same step under no_sync(): compute only) and "allreduce"
     (the gradient bytes alone, cut into the engines' buckets, all launched, then waited for).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
import workloads

ENGINES = {"minidp": minidp.DDP, "ddp": TorchDDP}


def summarize(seconds: list[float]) -> dict:
    """Median and spread (p10, p25, p75, p90) of a list of durations, plus the raw values."""
    a = np.asarray(seconds, dtype=float)
    p10, p25, p50, p75, p90 = np.percentile(a, [10, 25, 50, 75, 90])
    return {"median": float(p50), "p10": float(p10), "p25": float(p25), "p75": float(p75),
            "p90": float(p90), "n": len(seconds), "values": [round(s, 6) for s in seconds]}


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so that a wall-clock interval covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def engine_kwargs(job: dict, device: torch.device) -> dict:
    """The same constructor keywords for both engines."""
    kwargs = {"bucket_cap_mb": job["bucket_cap_mb"], "gradient_as_bucket_view": job["gbv"]}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    return kwargs


def construction_times(base, kwargs: dict, count: int, device) -> dict:
    """Seconds per constructor call, each engine on its own fresh copy, alternating.

    One untimed construction each comes first: the first DDP in a process pays one-off set-up
    (seconds), which is not what a constructor costs.
    """
    for engine in ENGINES.values():
        engine(workloads.clone(base), **kwargs)
    times = {name: [] for name in ENGINES}
    for i in range(count):
        order = list(ENGINES) if i % 2 == 0 else list(ENGINES)[::-1]
        for name in order:
            model = workloads.clone(base)  # not timed; a fresh copy so no hooks pile up on one model
            dist.barrier()  # ranks meet here: each constructor starts together on every rank
            times[name].append(timed(lambda name=name, model=model: ENGINES[name](model, **kwargs), device))
            del model
    return {name: summarize(values) for name, values in times.items()}


def allreduce_phase(bucket_numels: list[int], device) -> Callable[[], None]:
    """All-reduce flat tensors of the engines' bucket sizes: launch all, then wait (as backward does)."""
    tensors = [torch.ones(n, device=device) for n in bucket_numels]

    def run():
        works = [dist.all_reduce(t, async_op=True) for t in tensors]  # ranks meet here (async)
        for work in works:
            work.wait()
    return run


def make_phases(models: dict, opts: dict, x, y, limits: bool) -> dict[str, Callable[[], None]]:
    """The steps to time, by phase name (see the module docstring)."""
    phases = {name: (lambda m=m, o=opts[name]: workloads.train_step(m, o, x, y)) for name, m in models.items()}
    if limits:
        for name, m in models.items():
            phases[f"{name}_nosync"] = lambda m=m, o=opts[name]: _nosync_step(m, o, x, y)
    return phases


def _nosync_step(model, opt, x, y) -> None:
    with model.no_sync():  # the forward runs inside too, as both engines require
        workloads.train_step(model, opt, x, y)


def alternate(phases: dict, rounds: int, steps: int, device) -> dict[str, list[float]]:
    """Time `steps` steps of every phase per round; the order flips every round."""
    names, times = list(phases), {name: [] for name in phases}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            dist.barrier()  # ranks meet here: a phase never starts while a peer finishes the last one
            for _ in range(steps):
                times[name].append(timed(phases[name], device))
    return times


def bucket_numels(model: minidp.DDP) -> list[int]:
    """Elements per bucket of minidp's current layout (torch DDP's layout is the same by design)."""
    numel = {n: p.numel() for n, p in model.module.named_parameters()}
    return [sum(numel[n] for n in names) for names in model.bucket_plan()]


def run_job(job: dict, rank: int, device: torch.device) -> dict:
    """Measure one job on this rank; returns the raw numbers (rank 0's are reported)."""
    load = workloads.get(job["workload"], job["quick"])
    base = load.build(seed=0).to(device)
    x, y = load.batch_for(rank, device)
    kwargs = engine_kwargs(job, device)
    construction = construction_times(base, kwargs, job["constructions"], device)
    models = {name: engine(workloads.clone(base), **kwargs) for name, engine in ENGINES.items()}
    opts = {name: workloads.make_optimizer(m) for name, m in models.items()}
    phases = make_phases(models, opts, x, y, job["limits"])
    for fn in phases.values():
        for _ in range(job["warmup"]):
            fn()
    buckets = bucket_numels(models["minidp"])
    if job["limits"]:
        phases["allreduce"] = allreduce_phase(buckets, device)
        phases["allreduce"]()  # warm-up
    times = alternate(phases, job["rounds"], job["steps"], device)
    return {"job": job, "world_size": dist.get_world_size(), "device": str(device),
            "params": workloads.grad_numel(base), "batch_per_rank": load.batch, "bucket_numels": buckets,
            "construction": construction, "phases": {n: summarize(t) for n, t in times.items()}}


def run_autotune_job(job: dict, rank: int, device: torch.device) -> dict:
    """bucket_cap_mb="auto" against every fixed cap it may choose, and torch DDP with the cap it chose.

    minidp with "auto" trains until its tuner has chosen (timing the candidates on its own); then, in
    the same rounds: "minidp" (auto, tuned), "cap=<c>" (minidp with each candidate cap c) and "ddp"
    (torch DDP with the chosen cap). Returns the chosen cap, the tuner's own medians (rank 0's) and
    the phases.
    """
    load = workloads.get(job["workload"], job["quick"])
    base = load.build(seed=0).to(device)
    x, y = load.batch_for(rank, device)
    kwargs = engine_kwargs(job, device)
    auto = minidp.DDP(workloads.clone(base), **{**kwargs, "bucket_cap_mb": "auto"})
    opts = {"minidp": workloads.make_optimizer(auto)}
    tuning_steps = 0
    while auto.auto_bucket_cap.chosen is None and tuning_steps < 100:
        workloads.train_step(auto, opts["minidp"], x, y)
        tuning_steps += 1
    chosen = auto.auto_bucket_cap.chosen
    models = {"minidp": auto}
    for cap in auto.auto_bucket_cap.candidates:
        models[f"cap={cap:g}"] = minidp.DDP(workloads.clone(base), **{**kwargs, "bucket_cap_mb": cap})
    models["ddp"] = TorchDDP(workloads.clone(base), **{**kwargs, "bucket_cap_mb": chosen})
    for name, model in models.items():
        opts.setdefault(name, workloads.make_optimizer(model))
    phases = make_phases(models, opts, x, y, limits=False)
    for fn in phases.values():
        for _ in range(job["warmup"]):
            fn()
    times = alternate(phases, job["rounds"], job["steps"], device)
    tuner_ms = {f"{c:g}": m * 1e3 for c, m in auto.auto_bucket_cap.medians().items()}
    return {"job": job, "world_size": dist.get_world_size(), "device": str(device), "chosen": chosen,
            "tuning_steps": tuning_steps, "tuner_ms": tuner_ms,
            "params": workloads.grad_numel(base), "batch_per_rank": load.batch,
            "construction": None, "phases": {n: summarize(t) for n, t in times.items()}}


def wait_for_done_events(timeline, limit_s: float = 10.0) -> None:
    """Return once every "launch" in `timeline` has its "done" (or after `limit_s`).

    Why: "done" is recorded by the future's callback, on the thread that completed the future (gloo's),
    which can run just after the step that waited for the future has moved on; a snapshot taken at
    once then misses it (seen on a busy 2-core machine). Waiting here changes no recorded time.
    """
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        kinds = [kind for kind, _, _ in timeline.snapshot()]
        if kinds.count("done") >= kinds.count("launch"):
            return
        time.sleep(0.001)


def record_timeline(job: dict, rank: int, device: torch.device) -> dict:
    """Timelines of `job['steps']` minidp steps after warm-up; every rank's events, gathered on all.

    The loop marks forward/backward starts and the step end itself, so the picture shows the whole
    step; the reducer records the rest. Returns {"plan", "steps": [[events of rank 0, rank 1...]...]}.
    """
    load = workloads.get(job["workload"], job["quick"])
    x, y = load.batch_for(rank, device)
    model = minidp.DDP(load.build(seed=0).to(device), **engine_kwargs(job, device))
    opt = workloads.make_optimizer(model)
    for _ in range(job["warmup"]):
        workloads.train_step(model, opt, x, y)
    steps = []
    for _ in range(job["steps"]):
        timeline = model.enable_timeline()
        dist.barrier()  # ranks meet here: every recorded step starts together
        timeline.record("forward_start")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        timeline.record("backward_start")
        loss.backward()
        opt.step()
        synchronize(device)
        timeline.record("step_end")
        wait_for_done_events(timeline)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, timeline.snapshot())  # ranks meet here
        steps.append(gathered)
    model.disable_timeline()
    return {"job": job, "world_size": dist.get_world_size(), "plan": model.bucket_plan(), "steps": steps}
