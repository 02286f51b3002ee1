"""A timeline of one minidp training step: backward against each bucket's all-reduce, per rank.

    python benchmarks/overlap/timeline.py                 # mlp, 2 ranks, DDP's default buckets
    python benchmarks/overlap/timeline.py --workload resnet18 --bucket-cap-mb 5
    python benchmarks/overlap/timeline.py --quick --out /tmp/tl   # tiny sizes (the smoke test)

Records `--steps` steps after warm-up and keeps the one of median length (rank 0's clock), then
writes into OUT/results/ (OUT defaults to runs/timeline, ignored by git; --out benchmarks updates the
recorded ones):
  timeline_<workload>_<device>.json         Chrome/Perfetto trace: pid = rank, one track per lane
  timeline_<workload>_<device>.png          lanes: step phases, gradients ready, one per bucket
  timeline_<workload>_<device>_events.json  the raw events of every rank and the bucket plan
Open the trace at https://ui.perfetto.dev (or chrome://tracing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

from plot_timeline import plot_timelines  # noqa: E402

import worker  # noqa: E402 - after the path set-up above
import workloads  # noqa: E402
from minidp.engine.timeline import bucket_spans, write_chrome_trace  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=workloads.NAMES, default="mlp")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="default: DDP's (1 MiB first, then 25)")
    p.add_argument("--gbv", action="store_true", help="gradient_as_bucket_view=True")
    p.add_argument("--steps", type=int, default=7, help="recorded steps; the median-length one is kept")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the workload's tiny variant")
    p.add_argument("--out", default=os.path.join("runs", "timeline"),
                   help="folder whose results/ receives the files (default: runs/timeline, which git ignores; "
                        "--out benchmarks to update the recorded ones)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.steps < 1 or args.world_size < 1:
        raise SystemExit(f"--steps={args.steps} and --world-size={args.world_size} must be >= 1")
    return args


def median_step(steps: list[list]) -> list:
    """The recorded step (all ranks' events) whose rank-0 length is the median."""
    def length(step):
        stamps = [stamp for _, stamp, _ in step[0]]
        return max(stamps) - min(stamps)
    return sorted(steps, key=length)[len(steps) // 2]


def summary(events_by_rank: dict) -> str:
    """Per rank and bucket: launch delay after its last gradient, and all-reduce time (ms)."""
    lines = []
    for rank, events in events_by_rank.items():
        end = next((stamp for kind, stamp, _ in events if kind == "backward_end"), None)
        for s in bucket_spans(events):
            after = "" if end is None else f", done {(s['done'] - end) / 1e6:+.2f} ms vs backward end"
            lines.append(f"rank {rank} bucket {s['bucket']}: {s['params']} grads, launched "
                         f"{(s['launch'] - s['last_ready']) / 1e6:.3f} ms after its last one, all-reduce "
                         f"{(s['done'] - s['launch']) / 1e6:.2f} ms{after}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    job = {"kind": "timeline", "workload": args.workload, "quick": args.quick, "bucket_cap_mb": args.bucket_cap_mb,
           "gbv": args.gbv, "warmup": args.warmup, "steps": args.steps}
    result = worker.run_jobs([job], args.world_size, args.backend, args.device, args.threads, verbose=False)[0]
    events_by_rank = dict(enumerate(median_step(result["steps"])))
    stem = os.path.join(args.out, "results", f"timeline_{args.workload}_{args.device}")
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    write_chrome_trace(stem + ".json", events_by_rank)
    with open(stem + "_events.json", "w") as f:
        json.dump({"job": job, "world_size": args.world_size, "plan": result["plan"],
                   "events": {str(r): e for r, e in events_by_rank.items()}}, f)
    cap = "DDP default buckets" if args.bucket_cap_mb is None else f"bucket_cap_mb={args.bucket_cap_mb:g}"
    title = (f"minidp, {args.workload}{' (quick)' if args.quick else ''}, world size {args.world_size}, "
             f"{cap}, {len(result['plan'])} buckets, {args.device}/{args.backend}")
    plot_timelines(stem + ".png", events_by_rank, title)
    print(summary(events_by_rank))
    print(f"wrote {stem}.json (Perfetto), {stem}.png, {stem}_events.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
