"""ZeRO-1 at DDP's bytes: ZeroRedundancyOptimizer(reduce_scatter=True) beside the plain ZeRO step and torch's.

    python benchmarks/speed/zero_bytes.py                      # world size 2, forked CPU ranks
    python benchmarks/speed/zero_bytes.py --world-size 4 --steps 60

Four engines in the same processes, taking turns every step (drift of a shared machine hits all alike),
AdamW on an MLP of 8 Linear(512, 512) (2.1 M parameters, 8.4 MB):
  torch        torch DDP + torch's ZeroRedundancyOptimizer (all-reduce, step, broadcasts)
  minidp       minidp.DDP + minidp.ZeroRedundancyOptimizer (the same, minidp's)
  rs           minidp.DDP + ZeroRedundancyOptimizer(reduce_scatter=True) + hook_with_zero_reduce_scatter
  rs_overlap   the same with overlap_param_gather=True (the all-gathers end in the next forward)
A timed step is forward, backward, step(); medians over --steps after --warmup.
Bytes: torch's profiler records every c10d collective; a collective of S elements costs a rank
(N-1)/N S (reduce-scatter, all-gather, broadcast) or 2(N-1)/N S (all-reduce), printed in units of the
parameters' bytes. Caveat: torch 2.14's gloo runs a reduce-scatter as an all-reduce of the whole buffer
(the profiler shows a gloo:all_reduce under c10d::_reduce_scatter_base_): the bytes counted are the
collectives minidp asks for (what NCCL sends), not gloo's wire bytes; so on CPU the time shows no saving.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared"))
os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop lines (step_cost.py says why)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from collective_tally import tally  # noqa: E402  (shared/)
from rank_memory import alternate_every_step  # noqa: E402  (shared/: the alternate-every-step loop)
from torch import nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import minidp  # noqa: E402
from minidp.sharded.zero import hook_with_zero_reduce_scatter  # noqa: E402

WIDTH, DEPTH = 512, 8
ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)


def _build(engine):
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(DEPTH) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())])
    if engine == "torch":
        model = TorchDDP(net)
        return model, TorchZero(net.parameters(), torch.optim.AdamW, lr=1e-4)
    model = minidp.DDP(net)
    if engine == "minidp":
        return model, minidp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4)
    opt = minidp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, reduce_scatter=True, lr=1e-4)
    model.register_comm_hook(None, hook_with_zero_reduce_scatter(
        model, opt, overlap_param_gather=engine == "rs_overlap"))
    return model, opt


def _step(model, opt, x, y):
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _sent(model, opt, x, y, world_size) -> dict:
    """{collective: elements a rank sends} of one step (tests/test_zero_reduce_scatter.py's count)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=ALL_THREADS) as prof:
        _step(model, opt, x, y)
        model(x)  # an overlapped all-gather ends here
        dist.barrier()
    ring = (world_size - 1) / world_size
    whole, gloo, _ = tally(prof.events())
    if "c10d::allreduce_" in whole:  # tensor-list collectives record no shapes: their gloo events'
        whole["c10d::allreduce_"] = gloo["gloo:all_reduce"] - whole.get("c10d::_reduce_scatter_base_", 0)
    if "c10d::broadcast_" in whole:
        whole["c10d::broadcast_"] = gloo["gloo:broadcast"]
    return {name: (2 * ring if name == "c10d::allreduce_" else ring) * n for name, n in whole.items()}


def _rank(local_rank, steps, warmup, out_dir):
    torch.set_num_threads(1)
    minidp.init(backend="gloo")
    world_size = dist.get_world_size()
    engines = {name: _build(name) for name in ("torch", "minidp", "rs", "rs_overlap")}
    x, y = torch.randn(32, WIDTH), torch.randn(32, WIDTH)
    median_ms = alternate_every_step(engines, _step, x, y, steps, warmup)
    params = sum(p.numel() for p in engines["torch"][0].module.parameters())
    sent = {name: _sent(model, opt, x, y, world_size) for name, (model, opt) in engines.items()}
    weights = {name: torch.cat([p.detach().flatten() for p in m.module.parameters()])
               for name, (m, _) in engines.items()}
    diff = {name: (w - weights["minidp"]).abs().max().item() for name, w in weights.items()}
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"median_ms": median_ms, "sent": sent, "params": params, "max_diff": diff}, f)
    minidp.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="timed steps per engine (default 100)")
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args(argv)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    with tempfile.TemporaryDirectory() as out_dir:
        minidp.launch(_rank, nprocs=args.world_size, args=(args.steps, args.warmup, out_dir), start_method="fork")
        r = json.load(open(os.path.join(out_dir, "result.json")))
    print(f"torch {torch.__version__}, world size {args.world_size}, {args.steps} timed steps each "
          f"(+{args.warmup}), {r['params']:,} parameters, load before {' '.join(load)}")
    base = r["median_ms"]["torch"]
    n = args.world_size
    for name, ms in r["median_ms"].items():
        sent = sum(r["sent"][name].values()) / r["params"]
        per = ", ".join(f"{k.removeprefix('c10d::')} {v / r['params']:.3f}" for k, v in r["sent"][name].items())
        print(f"{name:11s} sent/step {sent:.3f} x params ({sent * n / max(n - 1, 1):.2f} (N-1)/N; {per})   "
              f"median step {ms:.2f} ms, x{ms / base:.3f} of torch's   max |w - minidp's| "
              f"{r['max_diff'][name]:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
