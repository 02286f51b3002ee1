"""Does ZeRO-1 hold 1/N of the optimizer state per rank, as torch's does, and at what step cost?

    python benchmarks/memory/zero.py            # world sizes 2 and 4, a 25 M-parameter model (a few minutes)
    python benchmarks/memory/zero.py --quick    # tiny model, world size 2 only (seconds; the smoke test)

Three configurations, each in fresh forked CPU ranks of its own (gloo, one thread a rank), so that
one configuration's peak memory never mixes with another's:

  ddp        torch DDP      + torch.optim.AdamW                                 (every rank: all the state)
  torch_zero torch DDP      + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  minidp_zero minidp.DDP    + minidp.ZeroRedundancyOptimizer(AdamW)

Per rank, after a few steps: the optimizer-state bytes, counted from the tensors the rank's (local)
optimizer holds, each storage once (deduplicated by untyped_storage().data_ptr()), split into the
moments (exp_avg, exp_avg_sq: 8 bytes a parameter in fp32) and AdamW's `step` (one 0-d fp32 tensor
per parameter tensor: 4 bytes a tensor, not a parameter); and the process's peak RSS (VmHWM, via
shared/memory.py's peak_mib). The prediction beside it is minidp.study.memory_model.predict_memory
(params, N, k=8, weight_bytes=4, grad_bytes=4): DDP's optimizer column and ZeRO-1's (1/N of it).

Then the step time: torch ZeRO (with torch DDP) and minidp ZeRO (with minidp.DDP) in the same two
processes, alternating every step as speed/step_cost.py does, median of each and their ratio; and the
same for the step inside backward (overlap_with_ddp=True with hook_with_zero_step and allreduce_hook,
DDP at bucket_cap_mb=25; and minidp's hook_with_zero_step_interleaved): torch's path on gloo needs its
hook's gloo refusal passed (its constructor's one backend check answered "nccl", as
tests/test_zero_overlap.py does), its steps are torch's code.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(os.path.dirname(HERE), "shared")
for path in (HERE, SHARED):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from heartbeat import heartbeat  # noqa: E402  (shared/heartbeat.py: a line every 30 s while ranks run)
from rank_memory import alternate_every_step, build_model, launch_json, rss_mib, state_bytes, storage_bytes  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

import minidp  # noqa: E402
from memory import peak_mib  # noqa: E402  (shared/memory.py: VmHWM on CPU)
from minidp.study.memory_model import predict_memory, predict_peak  # noqa: E402

CONFIGS = ("ddp", "torch_zero", "minidp_zero")
LR = 1e-3


def make(config: str, width: int, layers: int):
    """(wrapped model, optimizer, the optimizer that holds this rank's state)."""
    model = build_model(width, layers)
    if config == "ddp":
        ddp = TorchDDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
        return ddp, opt, opt
    if config == "torch_zero":
        ddp = TorchDDP(model)
        opt = TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        return ddp, opt, opt.optim
    ddp = minidp.DDP(model)
    if config == "mixed":  # a diagnostic, not one of the three: which half a peak difference comes from
        opt = TorchZero(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        return ddp, opt, opt.optim
    opt = minidp.ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
    return ddp, opt, opt.optim


def make_overlapped(engine: str, width: int, layers: int):
    """(model, ZeRO) with the step inside backward: minidp's hook and ZeRO on minidp.DDP, or torch's on torch DDP."""
    from unittest import mock

    from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = build_model(width, layers)
    if engine in ("minidp_overlap", "minidp_interleaved"):
        ddp = minidp.DDP(model)
        zero = minidp.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=LR)
        hooks = minidp.hooks
        make_hook = hooks.hook_with_zero_step if engine == "minidp_overlap" else hooks.hook_with_zero_step_interleaved
        ddp.register_comm_hook(None, make_hook(allreduce_hook, ddp, zero))
        return ddp, zero
    ddp = TorchDDP(model)
    zero = TorchZero(ddp.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=LR)
    with mock.patch.object(ddp_zero_hook.dist, "get_backend", lambda group=None: "nccl"):  # past the gloo refusal
        ddp.register_comm_hook(None, ddp_zero_hook.hook_with_zero_step(allreduce_hook, ddp, zero))
    return ddp, zero


def step(model, opt, x, y, sample=None) -> None:
    nn.functional.mse_loss(model(x), y).backward()
    if sample is not None:
        sample()
    if not getattr(opt, "_overlap_with_ddp", False):  # else the hook stepped inside backward
        opt.step()
    if sample is not None:
        sample()
    opt.zero_grad()


def counted(model, local_opt) -> int:
    """Bytes of the parameters, their .grad and the local optimizer's state, each storage once (DDP's
    buckets are not among them: torch's live in its C++ reducer; gradient_as_bucket_view is off)."""
    seen, params = set(), list(model.parameters())
    held = storage_bytes(params, seen) + storage_bytes([p.grad for p in params], seen)
    return held + sum(storage_bytes([v], seen) for st in local_opt.state.values() for v in st.values()
                      if torch.is_tensor(v))


def _memory_rank(local_rank, config, width, layers, steps, out_path):
    torch.set_num_threads(1)
    start_rss = rss_mib()  # what the forked rank starts with (the parent's pages it touches)
    minidp.init(backend="gloo")
    model, opt, local_opt = make(config, width, layers)
    x, y = torch.randn(4, width), torch.randn(4, width)
    peak = [0]  # the most counted() saw: after each backward and each step

    def sample():
        peak[0] = max(peak[0], counted(model, local_opt))

    for _ in range(steps):
        step(model, opt, x, y, sample)
    mine = {"state": state_bytes(local_opt), "start_rss_mib": start_rss, "peak_mib": peak_mib(torch.device("cpu")),
            "counted_peak": peak[0]}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)
    minidp.shutdown()


def _timing_rank(local_rank, width, layers, steps, warmup, out_path):
    torch.set_num_threads(1)
    minidp.init(backend="gloo")
    engines = {key: make(key, width, layers)[:2] for key in ("minidp_zero", "torch_zero")}
    engines |= {key: make_overlapped(key, width, layers)
                for key in ("minidp_overlap", "torch_overlap", "minidp_interleaved")}
    x, y = torch.randn(4, width), torch.randn(4, width)
    times = alternate_every_step(engines, step, x, y, steps, warmup)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    minidp.shutdown()


_launch = launch_json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, world size 2 only")
    p.add_argument("--width", type=int, default=2048, help="Linear width of the memory model (default 2048)")
    p.add_argument("--layers", type=int, default=6, help="Linear layers (default 6: 25.2 M parameters)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=[*CONFIGS, "mixed"],
                   help="configurations to measure (ddp first; 'mixed' = minidp.DDP + torch's ZeRO, a diagnostic)")
    p.add_argument("--no-timing", action="store_true", help="skip the step-time comparison")
    p.add_argument("--steps", type=int, default=3, help="steps before the state is counted (default 3)")
    p.add_argument("--time-width", type=int, default=None, help="Linear width of the timing model "
                   "(default: --width)")
    p.add_argument("--time-steps", type=int, default=60, help="timed steps per engine (default 60)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", help="also write the memory rows here")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.world_sizes, args.steps = 128, 3, [2], 2
        args.time_width, args.time_steps, args.warmup = 128, 10, 2
    time_width = args.time_width or args.width
    params = sum(q.numel() for q in build_model(args.width, args.layers).parameters())
    tensors = 2 * args.layers
    largest = args.width * args.width
    print(f"minidp from {os.path.dirname(minidp.__file__)}, torch {torch.__version__}; forked CPU ranks, gloo, "
          f"1 thread each")
    print(f"memory model: {args.layers} x Linear({args.width}, {args.width}) = {params:,} parameters in "
          f"{tensors} tensors (largest {largest:,}); batch 4; state counted after {args.steps} AdamW steps")
    print("state = exp_avg + exp_avg_sq bytes (+ `step`: 4 bytes per parameter tensor held, shown apart); "
          "predicted = predict_memory(params, N, k=8, weight_bytes=4, grad_bytes=4)['optimizer']")
    print("off = (max over ranks of moments) - DDP's moments / N, in units of the largest tensor's moments "
          f"({8 * largest / 2**20:.1f} MiB)")
    print("counted = the most, over ranks and samples (after each backward and step), of parameters + .grad + "
          "optimizer state; pred = predict_peak(units, N, 'DDP' or 'ZeRO-1', k=8, weight_bytes=4, grad_bytes=4)"
          "['without_buffers'] (the fullest rank's share of whole tensors; DDP's buckets, not counted, "
          "are its 'buffers'); over = counted / pred - 1")
    print()
    header = (f"{'N':>2} {'config':<12} {'state MiB/rank (min-max)':>25} {'step B':>7} {'predicted MiB':>13} "
              f"{'off':>6} {'counted':>8} {'pred':>7} {'over':>6} {'peak MiB/rank (max)':>19} {'start MiB':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    for n in args.world_sizes:
        pred = predict_memory(params, n, k=8, weight_bytes=4, grad_bytes=4)
        ddp_moments = None
        for config in args.configs:
            with heartbeat(f"N={n} {config}: {args.steps} AdamW steps on {n} ranks, memory sampled"):
                ranks = _launch(_memory_rank, n, (config, args.width, args.layers, args.steps))
            moments = [r["state"]["moments"] for r in ranks]
            steps_b = [r["state"]["step"] for r in ranks]
            if config == "ddp":
                ddp_moments = moments[0]
                predicted = pred[0]["optimizer"]
            else:
                predicted = pred[1]["optimizer"]
            off = (max(moments) - ddp_moments / n) / (8 * largest) if config != "ddp" and ddp_moments else 0.0
            peak = max(r["peak_mib"] for r in ranks)
            start = max(r["start_rss_mib"] for r in ranks)
            units = [[args.width * args.width, args.width]] * args.layers
            pred_peak = predict_peak(units, n, "DDP" if config == "ddp" else "ZeRO-1", k=8, weight_bytes=4,
                                     grad_bytes=4)
            top = max(r["counted_peak"] for r in ranks)
            row = {"world_size": n, "config": config, "moments_bytes": moments, "step_bytes": steps_b,
                   "predicted_bytes": predicted, "off_in_largest_tensor": off,
                   "peak_mib": [r["peak_mib"] for r in ranks], "start_rss_mib": [r["start_rss_mib"] for r in ranks],
                   "params_held": [r["state"]["params_held"] for r in ranks],
                   "counted_peak_bytes": [r["counted_peak"] for r in ranks], "predict_peak": pred_peak,
                   "malloc": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}
            rows.append(row)
            span = f"{min(moments) / 2**20:.1f}-{max(moments) / 2**20:.1f}"
            print(f"{n:>2} {config:<12} {span:>25} {max(steps_b):>7} {predicted / 2**20:>13.1f} {off:>6.2f} "
                  f"{top / 2**20:8.1f} {pred_peak['without_buffers'] / 2**20:7.1f} "
                  f"{top / pred_peak['without_buffers'] - 1:+6.1%} {peak:>19.1f} {start:>9.1f}", flush=True)
    print()
    for n in args.world_sizes:
        by = {r["config"]: r for r in rows if r["world_size"] == n}
        if "minidp_zero" not in by or "torch_zero" not in by:
            continue
        mz, tz = max(by["minidp_zero"]["peak_mib"]), max(by["torch_zero"]["peak_mib"])
        same = by["minidp_zero"]["moments_bytes"] == by["torch_zero"]["moments_bytes"]
        print(f"N={n}: minidp ZeRO state per rank equal to torch ZeRO's rank by rank: {same}; "
              f"peak minidp / torch ZeRO {mz:.1f} / {tz:.1f} MiB = {mz / tz:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "params": params, "memory": rows}, f, indent=1)
    if args.no_timing:
        return 0
    n = 2
    t_params = sum(q.numel() for q in build_model(time_width, args.layers).parameters())
    with heartbeat(f"step time: {args.warmup} + {args.time_steps} steps of each of 5 engines, alternating, "
                   f"on {n} ranks"):
        times = _launch(_timing_rank, n, (time_width, args.layers, args.time_steps, args.warmup))
    print(f"step time, N={n}, {args.layers} x Linear({time_width}, {time_width}) = {t_params:,} parameters, "
          f"{args.time_steps} timed steps each after {args.warmup}, alternating every step: median "
          f"minidp ZeRO {times['minidp_zero']:.2f} ms, torch ZeRO {times['torch_zero']:.2f} ms, "
          f"ratio {times['minidp_zero'] / times['torch_zero']:.3f}")
    print("step inside backward (overlap_with_ddp=True), the same run: "
          f"median minidp {times['minidp_overlap']:.2f} ms, "
          f"torch {times['torch_overlap']:.2f} ms, ratio {times['minidp_overlap'] / times['torch_overlap']:.3f}; "
          f"overlap / plain step: minidp {times['minidp_overlap'] / times['minidp_zero']:.3f}, "
          f"torch {times['torch_overlap'] / times['torch_zero']:.3f}")
    print(f"minidp's interleaved variant (each bucket stepped once its all-reduce is done): median "
          f"{times['minidp_interleaved']:.2f} ms, "
          f"/ torch's overlap path {times['minidp_interleaved'] / times['torch_overlap']:.3f}, "
          f"/ minidp plain step {times['minidp_interleaved'] / times['minidp_zero']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
