"""One training run of the compression study, on every rank of a launched world (used by study.py).

    rows = run_jobs(jobs, cfg)   # inside minidp.launch's worker: [(method, lr, seed), ...] one after another

A run: CharMLP from seed's initial weights, SGD momentum 0.9 (Adam, DeMo, 1-bit Adam: their own, see
task.optimizer) at a constant lr after a linear warm-up of START_ITER steps (the methods start after it:
task.method_start), the global batch drawn by (seed, step) and split over ranks, the validation loss every
cfg["eval_every"] steps (of the ranks' mean parameters: the same as rank 0's except under local SGD and
the DiLoCos), stopped after cfg["steps"] steps. Step times exclude the evaluations. Per run: steps to
cfg["target"] (None if never), the final validation loss, bytes per compressed step (the counter, and the
compressor's formula), and the collectives of one compressed step (1-bit Adam: and of a warm-up step).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import compression_task as task
import minidp


class _NoWires:
    """A minidp.DDP transport that sends nothing: the compute of a step alone, with DDP's bucket copies.

    A transport, not a comm hook: before 3bb5da5 minidp.DDP all-reduced a status after any comm hook,
    which would have put a collective into what the validation takes for compute. Still a transport,
    so that the no-communication step stays the one the recorded rows measured.
    """

    def __init__(self):
        self.world_size = dist.get_world_size()

    def check_device(self, device):
        pass

    def all_reduce(self, tensor):
        fut = torch.futures.Future()
        fut.set_result(tensor)  # the local gradient (the reducer's division by N follows: the values don't matter)
        return fut


@torch.no_grad()
def _mean_val_loss(module, text, averaged: bool) -> float:
    """The validation loss of the ranks' mean parameters, each rank scoring its share of the windows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = [p.detach().clone() for p in module.parameters()] if averaged else None
    if averaged:
        for p in module.parameters():
            p.div_(world)
            dist.all_reduce(p)  # ranks meet here: the mean parameters (measurement only, not the method's bytes)
    x, y = text.val
    mine = slice(rank * len(y) // world, (rank + 1) * len(y) // world)
    total = F.cross_entropy(module(x[mine]), y[mine], reduction="sum").reshape(1)
    dist.all_reduce(total)  # ranks meet here: the sum over every window
    if averaged:
        for p, s in zip(module.parameters(), saved):
            p.copy_(s)
    return total.item() / len(y)


def run_one(method: str, lr: float, seed: int, text: task.Text, cfg: dict) -> dict:
    """Train `method` at `lr` from `seed`; the same result on every rank. method "noop": compute only;
    "probe": compute, then one all-reduce of cfg["probe_bytes"] bytes in each step (the link as a training
    step meets it: ranks arrive as their compute ends, and with more ranks than cores a waiting rank
    yields its core)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    module = task.CharMLP(text.vocab, text.context)
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    spec = task.METHODS.get(method)
    recorder = task.RecordingDist() if method in ("exact", "Adam") else None  # DDP's bucket all-reduces, noted
    computing_only = method in ("noop", "probe")
    if spec in task.NO_DDP:  # DeMo, 1-bit Adam: their step communicates (a plain module, as their authors')
        model = module
    else:
        model = minidp.DDP(module, transport=_NoWires() if computing_only else recorder)
    opt = task.optimizer(method, module.parameters(), lr, cfg["freeze_step"])
    probe = torch.zeros(cfg["probe_bytes"] // 4) if method == "probe" else None
    if computing_only:
        stepper, counter = None, None
    else:
        stepper, counter = task.attach(model, method, cfg["start_iter"], opt)
    transport = recorder or getattr(counter, "transport", None) or getattr(
        getattr(counter, "channel", None), "transport", None)  # DeMo's and 1-bit Adam's are their channel's
    averaged = spec in ("local", "diloco", "streaming")
    start = task.method_start(method, cfg)
    times, curve, reached, snapshot = [], [], None, None
    # the collectives of a step of the method (probe) and, where they differ, of one before it (1-bit Adam)
    probes = {start + 2: "calls", **({2: "warmup_calls"} if spec == "onebit" else {})}
    noted = {"calls": [], "warmup_calls": []}
    for step in range(cfg["steps"]):
        if step == start:
            snapshot = _counters(counter)
        if transport is not None and step in probes:
            transport.calls.clear()
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / cfg["start_iter"])
        x, y = text.batch(step, seed, cfg["global_batch"], rank, world)
        began = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if probe is not None:
            dist.all_reduce(probe)  # ranks meet here: the probe's all-reduce, after this step's compute
        opt.step()
        if stepper is not None:
            stepper.step()
        times.append(time.perf_counter() - began)
        if transport is not None and step in probes:
            noted[probes[step]] = list(transport.calls)
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            if not torch.isfinite(loss):
                curve.append((step + 1, float("nan")))
                break  # diverged: no target, and every later step would be nan too
            curve.append((step + 1, _mean_val_loss(module, text, averaged)))
            if reached is None and curve[-1][1] <= cfg["target"]:
                reached = step + 1
                if cfg.get("stop_at_target"):
                    break
    if counter is not None and hasattr(counter, "close"):
        counter.close()
    if spec == "streaming":
        stepper.sync()  # lands the syncs in flight (their bytes were counted when they started)
    compressed = max(1, len(times) - start)
    measured, analytical = _counters(counter)
    base = snapshot or (0, 0)
    return {"method": method, "lr": lr, "seed": seed, "world_size": world, "steps_run": len(times),
            "per_rank_batch": cfg["global_batch"] // world,
            "steps_to_target": reached, "final_val_loss": curve[-1][1] if curve else None, "curve": curve,
            "time_to_target_s": sum(times[:reached]) if reached else None, "total_s": sum(times),
            "first_step_s": times[0] if times else None,  # one-time set-up (buckets, groups): left out of predictions
            "median_step_s": statistics.median(times[cfg["start_iter"] + 2:] or times),
            # the mean too: the work of a method that syncs every k steps (the DiLoCos' outer step, Streaming
            # DiLoCo's quantisation) is in one step of k, which the median leaves out
            "mean_step_s": statistics.fmean(times[cfg["start_iter"] + 2:] or times),
            "param_bytes": param_bytes,
            "bytes_measured": param_bytes if counter is None else (measured - base[0]) / compressed,
            "bytes_analytical": param_bytes if counter is None else (analytical - base[1]) / compressed,
            "method_start": start,
            **({"probe_bytes": cfg["probe_bytes"]} if probe is not None else {}),
            "collectives": [] if computing_only else task.collectives(
                method, noted["calls"], param_bytes, world, stepper),
            **({"warmup_collectives": task.collectives(method, noted["warmup_calls"], param_bytes, world)}
               if spec == "onebit" else {})}


def _counters(counter) -> tuple:
    if counter is None:
        return 0, 0
    sent = counter.stats()["bytes_sent"]
    return sent, getattr(counter, "bytes_analytical", sent)


def run_jobs(jobs: list, cfg: dict, log=None) -> list:
    """Each (method, lr, seed) of `jobs` in turn; `log(row)` after each (rank 0 only)."""
    text = task.Text.load(val_windows=cfg["val_windows"])
    rows = []
    for method, lr, seed, *override in jobs:  # a job may carry its own settings: (method, lr, seed, {...})
        rows.append(run_one(method, lr, seed, text, {**cfg, **(override[0] if override else {})}))
        if log is not None and dist.get_rank() == 0:
            log(rows[-1])
    return rows
