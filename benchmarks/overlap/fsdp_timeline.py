"""A timeline of one minidp.fully_shard step: each unit's all-gather and reduce-scatter against compute.

    python benchmarks/overlap/fsdp_timeline.py                  # 6 x Linear(2048, 2048), 2 ranks
    python benchmarks/overlap/fsdp_timeline.py --quick --out /tmp/tl   # tiny sizes

The model is memory/fully_shard.py's (`layers` x (Linear, Tanh), minidp.fully_shard on each Linear,
then on the root; AdamW). The root's enable_timeline() records each collective as a span, from its
start to the host's wait for it (lanes "fully_shard all-gather" and "fully_shard reduce-scatter",
named by the unit's module); this script adds, on the same Timeline, the step's phases (forward,
backward, optimizer) and each Linear's compute (forward and backward, from module hooks). Records
`--steps` steps after warm-up and keeps the one of median length (rank 0's clock), then writes into
OUT/results/ (OUT defaults to runs/fsdp_timeline, ignored by git; --out benchmarks updates the recorded
ones):
  fsdp_timeline_cpu.png    one panel per rank: step phases, then the collectives' and compute lanes
  fsdp_timeline_cpu.json   Chrome/Perfetto trace (pid = rank), https://ui.perfetto.dev
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from plot_timeline import plot_timelines  # noqa: E402
from rank_memory import build_model  # noqa: E402  (memory/fully_shard.py's model)
from timeline import median_step  # noqa: E402  (overlap/timeline.py)
from torch import nn  # noqa: E402

import minidp  # noqa: E402
import worker  # noqa: E402
from minidp.engine.timeline import named_spans, write_chrome_trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--reshard-after-forward", type=int, choices=(0, 1), default=1)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=7, help="recorded steps; the median-length one is kept")
    p.add_argument("--quick", action="store_true", help="4 x Linear(128, 128), 3 steps")
    p.add_argument("--out", default=os.path.join("runs", "fsdp_timeline"),
                   help="folder whose results/ receives the files (default: runs/fsdp_timeline, which git "
                        "ignores; --out benchmarks to update the recorded ones)")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.warmup, args.steps = 128, 4, 1, 3
    return args


def hook_compute(model: nn.Module, get_timeline) -> None:
    """Record each Linear's forward and backward as spans on the current timeline."""
    def span(kind, lane, name):
        return lambda *a: get_timeline().record(kind, lane=lane, name=name)
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            m.register_forward_pre_hook(span("begin", "compute: forward", name))
            m.register_forward_hook(span("end", "compute: forward", name))
            m.register_full_backward_pre_hook(span("begin", "compute: backward", name))
            m.register_full_backward_hook(span("end", "compute: backward", name))


def _entry(local_rank, args, out_path):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the first Linear's
    minidp.init(backend="gloo")
    model = build_model(args.width, args.layers)
    for m in model:
        if isinstance(m, nn.Linear):
            minidp.fully_shard(m, reshard_after_forward=bool(args.reshard_after_forward))
    minidp.fully_shard(model, reshard_after_forward=bool(args.reshard_after_forward))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen)
    current = {"timeline": model.enable_timeline()}
    hook_compute(model, lambda: current["timeline"])
    steps = []
    for i in range(args.warmup + args.steps):
        timeline = current["timeline"] = model.enable_timeline()  # a fresh one per step
        dist.barrier()  # ranks meet here: each step starts together
        timeline.record("forward_start")
        loss = nn.functional.mse_loss(model(x), y)
        timeline.record("backward_start")
        loss.backward()
        timeline.record("backward_end")
        timeline.record("finalize_end")  # fully_shard's end of backward is inside backward()
        opt.step()
        opt.zero_grad()
        timeline.record("step_end")
        if i >= args.warmup:
            mine = [list(e) for e in timeline.snapshot()]
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)  # ranks meet here
            steps.append(everyone)
    worker.save_and_shut_down({"steps": steps}, dist.get_rank(), out_path)


def overlap_summary(events_by_rank: dict) -> str:
    """Per rank: how much of the collectives' time runs beside compute spans, in ms."""
    lines = []
    for rank, events in events_by_rank.items():
        spans = named_spans(events)
        compute = [(s, e) for lane, _, s, e in spans if lane.startswith("compute")]
        for lane in ("fully_shard all-gather", "fully_shard reduce-scatter"):
            comm = [(s, e) for name, _, s, e in spans if name == lane]
            total = sum(e - s for s, e in comm)
            beside = sum(max(0, min(e, ce) - max(s, cs)) for s, e in comm for cs, ce in compute)
            lines.append(f"rank {rank} {lane}: {len(comm)} spans, {total / 1e6:.1f} ms in all, "
                         f"{beside / 1e6:.1f} ms of it beside a Linear's compute")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = worker.launch_for_json(_entry, args.world_size, (args,))
    events_by_rank = {rank: [tuple(e) for e in events] for rank, events in
                      enumerate(median_step(result["steps"]))}
    stem = os.path.join(args.out, "results", "fsdp_timeline_cpu")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    write_chrome_trace(stem + ".json", events_by_rank)
    title = (f"minidp.fully_shard, {args.layers} x Linear({args.width}, {args.width}), one unit each, "
             f"reshard_after_forward={bool(args.reshard_after_forward)}, world size {args.world_size}, "
             f"batch {args.batch}/rank, cpu/gloo")
    plot_timelines(stem + ".png", events_by_rank, title)
    print(overlap_summary(events_by_rank))
    print(f"wrote {stem}.png, {stem}.json (Perfetto)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
