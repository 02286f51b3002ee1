"""minidp against torch DDP, side by side, in the same processes: step time, limits, construction, memory.

    python benchmarks/speed/compare_ddp.py            # full run on this machine (minutes)
    python benchmarks/speed/compare_ddp.py --quick --out /tmp/bench   # tiny sizes, seconds (the smoke test)
    python benchmarks/speed/compare_ddp.py --device cuda              # NCCL, one process per GPU
    python benchmarks/speed/compare_ddp.py --device cuda --backend gloo --world-sizes 1,2  # ranks share a GPU

Writes OUT/results/compare_ddp_<device>.json (every raw step time), OUT/results/step_times_<device>.png
and the tables into OUT/RESULTS.md (between markers, so hand-written notes around them survive).
OUT defaults to runs/compare_ddp (ignored by git; --out benchmarks updates the recorded ones). How the
numbers are taken: see shared/measure.py and shared/memory.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import report  # noqa: E402 - after the path set-up above
import worker  # noqa: E402
import workloads  # noqa: E402

FULL = {"rounds": 10, "steps": 4, "warmup": 3, "constructions": 5, "sweep_rounds": 6, "memory_steps": 8,
        "memory_repeats": 3}
QUICK = {"rounds": 2, "steps": 2, "warmup": 3, "constructions": 2, "sweep_rounds": 1, "memory_steps": 4,
         "memory_repeats": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, few steps: a smoke run of seconds")
    p.add_argument("--out", default=os.path.join("runs", "compare_ddp"),
                   help="folder for RESULTS.md and results/ (default: runs/compare_ddp, which git ignores; "
                        "--out benchmarks to update the recorded ones)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--world-sizes", help="comma-separated (default: 1,2 on cpu; 1..#GPUs on cuda)")
    p.add_argument("--workloads", default=",".join(workloads.NAMES))
    p.add_argument("--bucket-caps", help="bucket_cap_mb sweep, '' to skip (default 1,5,25,100; quick 1,100)")
    p.add_argument("--sweep-workloads", help="workloads of the sweep (default mlp,resnet18; quick mlp)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-engine memory processes")
    p.add_argument("--no-autotune", action="store_true", help='skip bucket_cap_mb="auto" against the caps')
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--from-json", help="rewrite RESULTS.md and the plot from a saved results JSON; run nothing")
    for name in FULL:
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"default {FULL[name]} ({QUICK[name]} quick)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded as the command (main(argv) too)
    for name in FULL:
        if getattr(args, name) is None:
            setattr(args, name, (QUICK if args.quick else FULL)[name])
    if args.bucket_caps is None:
        args.bucket_caps = "1,100" if args.quick else "1,5,25,100"
    if args.sweep_workloads is None:
        args.sweep_workloads = "mlp" if args.quick else "mlp,resnet18"
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.world_sizes = [int(w) for w in (args.world_sizes or default_world_sizes(args)).split(",")]
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.bucket_caps = [float(c) for c in args.bucket_caps.split(",") if c]
    args.sweep_workloads = [w for w in args.sweep_workloads.split(",") if w in args.workloads]
    check_args(args)
    return args


def default_world_sizes(args) -> str:
    if args.device == "cuda":
        import torch
        return ",".join(str(w) for w in range(1, max(1, torch.cuda.device_count()) + 1))
    return "1,2"


def check_args(args) -> None:
    unknown = set(args.workloads) - set(workloads.NAMES)
    if unknown:
        raise SystemExit(f"--workloads: unknown {sorted(unknown)}; choose from {workloads.NAMES}")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
        if args.backend == "nccl" and max(args.world_sizes) > torch.cuda.device_count():
            raise SystemExit(f"--backend nccl needs one GPU per rank: world size {max(args.world_sizes)} > "
                             f"{torch.cuda.device_count()} GPU(s); use --backend gloo to share a GPU")
    elif args.backend == "nccl":
        raise SystemExit("--backend nccl needs --device cuda")


def job(args, kind: str, workload: str, cap=None, gbv=False, **extra) -> dict:
    base = {"kind": kind, "workload": workload, "quick": args.quick, "bucket_cap_mb": cap, "gbv": gbv}
    if kind == "memory":
        return {**base, "steps": args.memory_steps, **extra}
    return {**base, "warmup": args.warmup, "rounds": args.rounds, "steps": args.steps,
            "constructions": args.constructions, "limits": False, **extra}


def plan_timing(args, world_size: int) -> list[dict]:
    """Defaults (with limits) at every world size; gbv=True and the cap sweep at the largest."""
    jobs = [job(args, "timing", w, limits=True) for w in args.workloads]
    if world_size == max(args.world_sizes):
        variant = {"rounds": args.sweep_rounds, "constructions": 1}
        jobs += [job(args, "timing", w, gbv=True, **variant) for w in args.workloads]
        jobs += [job(args, "timing", w, cap=c, **variant) for w in args.sweep_workloads for c in args.bucket_caps]
    return jobs


def plan_autotune(args) -> list[dict]:
    """bucket_cap_mb="auto" against each fixed cap, per workload, at the largest world size (one launch)."""
    if args.no_autotune:
        return []
    variant = {"rounds": args.sweep_rounds, "constructions": 0}
    names = args.workloads[:1] if args.quick else args.workloads  # quick: a smoke run of the job
    return [job(args, "autotune", w, cap="auto", **variant) for w in names]


def plan_memory(args) -> list[dict]:
    """One launch per (workload, gbv, engine, repeat) at the largest world size; quick: first workload only
    (at the smallest world size, see run_all).

    Repeats, with the engine order flipped each time, because a process's peak RSS varies by tens of
    MiB from run to run (the allocator); the report takes the median.
    """
    if args.no_memory:
        return []
    names = args.workloads[:1] if args.quick else args.workloads
    gbvs = (False,) if args.quick else (False, True)
    jobs = []
    for r in range(args.memory_repeats):
        engines = list(report.ENGINE_LABEL)[::1 if r % 2 == 0 else -1]
        jobs += [job(args, "memory", w, gbv=g, engine=e, repeat=r) for w in names for g in gbvs for e in engines]
    return jobs


def machine(args) -> dict:
    """What ran the benchmark, for the record."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass  # lscpu is a nicety; platform's answer will do
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {"commit": git_commit(), "cpu": cpu,
            "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "device": args.device,
            "backend": args.backend, "world_sizes": args.world_sizes, "threads": args.threads,
            "command": ("python benchmarks/speed/compare_ddp.py " + shlex.join(args.argv)).strip(),
            **{k: getattr(args, k) for k in FULL}}


def git_commit() -> str:
    """HEAD of the checkout, with "+dirty" when minidp/ has uncommitted changes (the engine measured)."""
    root = os.path.dirname(BENCHMARKS)
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "minidp"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def run_all(args) -> tuple[list[dict], list[dict], list[dict]]:
    """Every timing launch (one per world size), the autotune launch, then every memory launch."""
    timing, memory = [], []
    for world_size in args.world_sizes:
        jobs = plan_timing(args, world_size)
        print(f"world size {world_size}: {len(jobs)} timing jobs", flush=True)
        timing += worker.run_jobs(jobs, world_size, args.backend, args.device, args.threads)
    autotune = plan_autotune(args)
    if autotune:
        autotune = worker.run_jobs(autotune, max(args.world_sizes), args.backend, args.device, args.threads)
    # Quick: the smallest world size, so the smoke run starts one process per engine, not one per rank.
    memory_world = min(args.world_sizes) if args.quick else max(args.world_sizes)
    for one in plan_memory(args):
        memory += worker.run_jobs([one], memory_world, args.backend, args.device, args.threads)
    for result in timing:
        result["derived"] = report.derive(result)
    return timing, memory, autotune


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        meta, timing, memory, autotune = saved["meta"], saved["timing"], saved["memory"], saved.get("autotune", [])
        for result in timing:  # recomputed: the report's definitions may have moved on
            result["derived"] = report.derive(result)
    else:
        started = time.perf_counter()
        timing, memory, autotune = run_all(args)
        meta = {**machine(args), "wall_s": round(time.perf_counter() - started, 1),
                "plot": f"results/step_times_{args.device}.png"}
    results_dir = os.path.join(args.out, "results")
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, f"compare_ddp_{meta['device']}.json"), "w") as f:
        json.dump({"meta": meta, "timing": timing, "memory": memory, "autotune": autotune}, f, indent=1)
    report.plot_step_times(timing, os.path.join(args.out, meta["plot"]))
    text = report.section(meta, timing, memory, autotune)
    report.write_section(os.path.join(args.out, "RESULTS.md"), meta["device"], text)
    print(text)
    print(f"\nwrote {args.out}/RESULTS.md and {results_dir}/ in {meta['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
