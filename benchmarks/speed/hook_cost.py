"""What one gradient costs an engine: backward time over the plain module's, per gradient, and in what.

    python benchmarks/speed/hook_cost.py           # deep300 (300 x Linear(64, 64)), world sizes 1 and 2
    python benchmarks/speed/hook_cost.py --quick   # a smoke run of seconds

Per world size, in the same processes, phases alternating round by round (order flipped each round):
  plain      the module alone (no engine): loss.backward()
  minidp     minidp.DDP: loss.backward(), hooks, bucket copies, launches, the end-of-backward wait
  ddp        torch DDP, the same
Per-gradient cost = (median backward of the engine - median backward of plain) / number of gradients,
in microseconds. Then one profiled minidp backward (cProfile): the functions of minidp that ran, with
calls per gradient and their own time per gradient (profiling inflates times; the shares are what
matter). Forward and the optimizer step run untimed between the timed backwards.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import minidp  # noqa: E402 - after the path set-up above
import worker  # noqa: E402
import workloads  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="timed backwards per phase and round")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    return args


def timed_backward(model, x, y) -> float:
    """One step; returns the seconds of its loss.backward() alone."""
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x), y)
    start = time.perf_counter()
    loss.backward()
    return time.perf_counter() - start


def profile_minidp(model, x, y, n_grads: int) -> list[dict]:
    """minidp's own functions during one backward: calls and own time per gradient (cProfile)."""
    for p in model.parameters():
        p.grad = None
    loss = F.cross_entropy(model(x), y)
    prof = cProfile.Profile()
    prof.enable()
    loss.backward()
    prof.disable()
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        if "minidp" in path or name.startswith("<built-in") or name.startswith("<method"):
            rows.append({"function": f"{os.path.basename(path)}:{line}({name})", "calls_per_grad": calls / n_grads,
                         "own_us_per_grad": own / n_grads * 1e6, "cum_us_per_grad": cum / n_grads * 1e6})
    return sorted(rows, key=lambda r: -r["own_us_per_grad"])[:15]


def _entry(local_rank, args, out_path):
    torch.set_num_threads(1)
    env = minidp.init(backend="gloo")
    load = workloads.get("deep300", args.quick)
    base = load.build(seed=0)
    x, y = load.batch_for(env.rank, "cpu")
    models = {"plain": workloads.clone(base), "minidp": minidp.DDP(workloads.clone(base)),
              "ddp": TorchDDP(workloads.clone(base))}
    n_grads = sum(1 for p in base.parameters() if p.requires_grad)
    for model in models.values():
        for _ in range(3):  # warm-up; both engines rebuild their buckets after the first
            timed_backward(model, x, y)
    times = {name: [] for name in models}
    for r in range(args.rounds):
        for name in list(models) if r % 2 == 0 else list(models)[::-1]:
            torch.distributed.barrier()  # ranks meet here: phases start together
            times[name] += [timed_backward(models[name], x, y) for _ in range(args.steps)]
    medians = {name: float(np.median(t)) for name, t in times.items()}
    result = {"world_size": env.world_size, "grads": n_grads, "backward_ms": {k: v * 1e3 for k, v in medians.items()},
              "per_grad_us": {e: (medians[e] - medians["plain"]) / n_grads * 1e6 for e in ("minidp", "ddp")},
              "profile": profile_minidp(models["minidp"], x, y, n_grads)}
    worker.save_and_shut_down(result, env.rank, out_path)


def describe(r: dict) -> str:
    """One world size's figures, as printed."""
    lines = [f"world size {r['world_size']}: {r['grads']} gradients; backward ms (median): "
             + ", ".join(f"{k} {v:.2f}" for k, v in r["backward_ms"].items()),
             "  per-gradient cost over plain: " + ", ".join(f"{k} {v:.2f} us" for k, v in r["per_grad_us"].items()),
             "  minidp backward under cProfile, per gradient: calls, own us, cumulative us"]
    lines += [f"    {row['calls_per_grad']:5.2f} {row['own_us_per_grad']:7.2f} {row['cum_us_per_grad']:7.2f}  "
              f"{row['function']}" for row in r["profile"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = [worker.launch_for_json(_entry, world_size, (args,), timeout=900) for world_size in args.world_sizes]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(describe(r) for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
