"""What a default step costs beside torch DDP's: collectives per step, and the step time ratio.

    python benchmarks/speed/step_cost.py                  # world size 2, forked CPU ranks (a minute)
    PYTHONPATH=/path/to/other/checkout python benchmarks/speed/step_cost.py   # another version of minidp

Both engines run in the same processes, alternating every step (so drift of a shared machine hits
both alike), on models where a fixed cost per step shows: a small MLP (microseconds of compute) and a
deeper one. Collectives are counted with torch's profiler (c10d ops, whichever engine issued them).
Prints one line per model: collectives per step of each engine, the median step of each, the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared"))
# torch 2.14's profiler (Kineto) logs every start and stop ("USDT: ... profiler_start") and, without a GPU,
# "gpuGetDeviceCount failed": four lines per rank per profiled step, around the results. Level 6 keeps them
# out (the forked ranks inherit it); set KINETO_LOG_LEVEL yourself to see them.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_memory import alternate_every_step  # noqa: E402  (shared/: the alternate-every-step loop)
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import minidp  # noqa: E402

MODELS = {
    "mlp_small": lambda: nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)),
    "mlp_deep": lambda: nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(256, 256), nn.Tanh())]),
}


def _engine_step(model, opt, x, y):
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _collectives(model, opt, x, y) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _engine_step(model, opt, x, y)
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _rank(local_rank, steps, warmup, out_dir):
    torch.set_num_threads(1)
    minidp.init(backend="gloo")
    results = {}
    for name, build in MODELS.items():
        engines = {}
        for key, wrap in (("minidp", minidp.DDP), ("torch", TorchDDP)):
            torch.manual_seed(0)
            model = wrap(build())
            engines[key] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        width_in = next(iter(engines["torch"][0].module.parameters())).shape[1]
        width_out = list(engines["torch"][0].module.parameters())[-1].shape[0]
        x, y = torch.randn(16, width_in), torch.randn(16, width_out)
        median_ms = alternate_every_step(engines, _engine_step, x, y, steps, warmup)
        counts = {key: _collectives(model, opt, x, y) for key, (model, opt) in engines.items()}
        results[name] = {"collectives": counts, "median_ms": median_ms}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    minidp.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300, help="timed steps per engine and model (default 300)")
    p.add_argument("--warmup", type=int, default=20)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as out_dir:
        minidp.launch(_rank, nprocs=args.world_size, args=(args.steps, args.warmup, out_dir), start_method="fork")
        results = json.load(open(os.path.join(out_dir, "result.json")))
    print(f"minidp from {os.path.dirname(minidp.__file__)}, torch {torch.__version__}, "
          f"world size {args.world_size}, {args.steps} timed steps each")
    for name, r in results.items():
        c, t = r["collectives"], r["median_ms"]
        print(f"{name:10s} collectives/step minidp {c['minidp']} torch {c['torch']}   median step ms "
              f"minidp {t['minidp']:.3f} torch {t['torch']:.3f}   ratio {t['minidp'] / t['torch']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
