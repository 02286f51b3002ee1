"""Overlap under torch.compile: eager against compiled, minidp against torch DDP, in the same processes.

    python benchmarks/overlap/compile_timeline.py    # 16-layer 512-wide MLP, 1 MiB buckets, 2 ranks, inductor
    python benchmarks/overlap/compile_timeline.py --quick  # tiny MLP, aot_eager: a smoke run of seconds
    python benchmarks/overlap/compile_timeline.py --device cuda

Phases (each its own copy of the same weights, fed the same batches, all in the same processes):
  minidp eager                minidp.DDP(m)
  minidp compiled, whole      minidp.DDP(torch.compile(m)) with its graph left whole, as before
                              graph_split.py (every gradient ready at the end of backward)
  minidp DDP(compile(m))      the graph cut at bucket boundaries (graph_split.py)
  minidp compile(DDP(m))      the same, wrapped the other way round
  torch eager, torch DDP(compile(m)), torch compile(DDP(m))   torch DDP (+ dynamo's DDPOptimizer)

Per phase: the median step time (forward, backward, SGD step) over --rounds x --steps timed steps,
phases alternating and the order flipped every round, after --warmup steps (compiles included);
for minidp's phases also, over --timeline-steps recorded steps, the median gradient-ready spread
(last "grad_ready" minus first) and bucket 0's lead (its "launch" to "backward_end"). Weights are
compared at the end: phases that run the same kernels on the same batches end bitwise equal.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import measure  # noqa: E402 - after the path set-up above
import minidp  # noqa: E402
import worker  # noqa: E402
from minidp.engine import planning  # noqa: E402

PAIRS = (("minidp eager", "torch eager"), ("minidp DDP(compile(m))", "torch DDP(compile(m))"),
         ("minidp compile(DDP(m))", "torch compile(DDP(m))"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, batch 8, aot_eager, few steps")
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per phase and round")
    p.add_argument("--timeline-steps", type=int, default=15)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write every number here")
    args = p.parse_args(argv)
    if args.quick:
        # Width 512 and 1 MiB buckets still: torch DDP + compile refuses a bucket_cap_mb below 1
        # (DDPOptimizer's first bucket is always 1 MiB and may not exceed the others).
        args.depth, args.batch, args.compile_backend = 4, 8, "aot_eager"
        args.rounds, args.steps, args.timeline_steps = 2, 2, 3
    return args


class MLP(nn.Module):
    """`depth` x (Linear(width, width), ReLU).

    A class of its own, as user models are: torch.compile(torch DDP(m)) compiles the module's forward
    as a frame of its own, and dynamo never starts a frame in torch.nn's code (a bare nn.Sequential
    there would run eagerly under torch DDP).
    """

    def __init__(self, depth: int, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.layers(x)


def build_phases(args, device) -> dict:
    """Name -> model; every model starts from the same weights."""
    base = MLP(args.depth, args.width).to(device)
    clone = lambda: copy.deepcopy(base)  # noqa: E731 - one line, used six times below
    compiled = lambda m: torch.compile(m, backend=args.compile_backend)  # noqa: E731
    kwargs = {"bucket_cap_mb": args.bucket_cap_mb, "device_ids": [device.index] if device.type == "cuda" else None}
    whole = minidp.DDP(compiled(clone()), **kwargs)
    whole._run_module.limits = [planning.UNBOUNDED]  # one piece: the whole graph, as before graph_split.py
    return {"minidp eager": minidp.DDP(clone(), **kwargs), "minidp compiled, whole": whole,
            "minidp DDP(compile(m))": minidp.DDP(compiled(clone()), **kwargs),
            "minidp compile(DDP(m))": compiled(minidp.DDP(clone(), **kwargs)),
            "torch eager": TorchDDP(clone(), **kwargs), "torch DDP(compile(m))": TorchDDP(compiled(clone()), **kwargs),
            "torch compile(DDP(m))": compiled(TorchDDP(clone(), **kwargs))}


def minidp_of(model):
    """The minidp.DDP inside a phase's model, or None (torch DDP)."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, minidp.DDP) else None


class Phase:
    """One model with its optimizer and its own walk through the shared batches."""

    def __init__(self, model, batches, device):
        self.model, self.batches, self.device, self.step_count = model, batches, device, 0
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(self) -> None:
        x, y = self.batches[self.step_count % len(self.batches)]
        self.step_count += 1
        self.opt.zero_grad()
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()

    def recorded_step(self) -> tuple[float, float] | None:
        """(gradient-ready spread, bucket 0 lead) in ms of one step; None for torch DDP."""
        ddp = minidp_of(self.model)
        if ddp is None:
            self.step()
            return None
        timeline = ddp.enable_timeline()
        self.step()
        measure.synchronize(self.device)
        ddp.disable_timeline()
        events = timeline.snapshot()
        ready = [t for kind, t, _ in events if kind == "grad_ready"]
        launch0 = next(t for kind, t, f in events if kind == "launch" and f["bucket"] == 0)
        end = next(t for kind, t, _ in events if kind == "backward_end")
        return (max(ready) - min(ready)) / 1e6, (end - launch0) / 1e6


def run(args, rank: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch, args.width, generator=gen).to(device),
                torch.randn(args.batch, args.width, generator=gen).to(device)) for _ in range(4)]
    phases = {name: Phase(model, batches, device) for name, model in build_phases(args, device).items()}
    for phase in phases.values():
        for _ in range(args.warmup):  # compiles, and the buckets' rebuild after the first step
            phase.step()
    times = measure.alternate({name: phase.step for name, phase in phases.items()}, args.rounds, args.steps, device)
    recorded = {name: [] for name in phases}
    for i in range(args.timeline_steps):
        for name in phases if i % 2 == 0 else list(phases)[::-1]:
            torch.distributed.barrier()  # ranks meet here: each recorded step starts together
            recorded[name].append(phases[name].recorded_step())
    weights = {name: [p.detach().cpu() for p in phase.model.parameters()] for name, phase in phases.items()}
    return {"args": vars(args), "step_ms": {n: measure.summarize(t)["median"] * 1e3 for n, t in times.items()},
            "spread_ms": {n: float(np.median([r[0] for r in v])) for n, v in recorded.items() if v[0]},
            "lead_ms": {n: float(np.median([r[1] for r in v])) for n, v in recorded.items() if v[0]},
            "pieces": {n: _pieces(phase.model) for n, phase in phases.items()},
            "bitwise": {f"{a} = {b}": _equal(weights[a], weights[b]) for a, b in PAIRS + (
                ("minidp DDP(compile(m))", "minidp compile(DDP(m))"),)}}


def _pieces(model) -> int | None:
    ddp = minidp_of(model)
    splitters = ddp._run_module.splitters if ddp is not None else []
    return max(max(s.pieces) for s in splitters) if splitters else None


def _equal(a: list, b: list) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def table(result: dict) -> str:
    """The markdown table for RESULTS.md."""
    a = result["args"]
    lines = [f"{a['depth']}-layer MLP, width {a['width']}, batch {a['batch']}/rank, "
             f"bucket_cap_mb={a['bucket_cap_mb']:g}, world size {a['world_size']}, {a['device']}, "
             f"backend {a['compile_backend']}; medians",
             "", "| phase | step (ms) | minidp / torch | grad-ready spread (ms) | bucket 0 lead (ms) | pieces |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    ratio = {ours: result["step_ms"][ours] / result["step_ms"][theirs] for ours, theirs in PAIRS}
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    for name, ms in result["step_ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {fmt(ratio.get(name), '.3f')} | "
                     f"{fmt(result['spread_ms'].get(name), '.1f')} | {fmt(result['lead_ms'].get(name), '.1f')} | "
                     f"{fmt(result['pieces'].get(name), 'd')} |")
    lines += ["", "bitwise equal weights at the end: " + ", ".join(
        f"{pair}: {'yes' if same else 'NO'}" for pair, same in result["bitwise"].items())]
    return "\n".join(lines)


def _entry(local_rank, args, out_path):
    torch.set_num_threads(args.threads)  # one thread per rank by default: 2 cores on this machine
    env = minidp.init(backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device("cuda", env.local_rank) if args.device == "cuda" else torch.device("cpu")
    worker.save_and_shut_down(run(args, env.rank, device), env.rank, out_path)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = worker.launch_for_json(_entry, args.world_size, (args,))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
