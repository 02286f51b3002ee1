"""Point minidp at a model and see what DDP does with it: buckets, when each is launched, the timeline.

    python -m minidp.explain resnet18 --world-size 2 --input-shape 3,32,32
    python -m minidp.explain mypkg.models:make_net --input-shape 128 --bucket-cap-mb 5 --json
    python -m minidp.explain resnet18 --input-shape 3,32,32 --zero-overlap interleaved  # ZeRO steps in backward

Runs a few real steps on CPU ranks (gloo), under minidp and then under torch DDP, and prints per
bucket, at construction and after the rebuild: index, parameters, MiB, first and last parameter,
and when it was launched relative to the start of backward; says whether torch DDP built the same
buckets (read through a comm hook on torch DDP); writes the timeline PNG, a Perfetto trace and the
recorded events (the input of `python -m minidp.simulate`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile

import torch

from ..engine.timeline import named_spans
from ..launcher.spawn import launch
from ..validate import check_bool, check_int, check_number
from . import record
from .plot import check_writable

DEFAULT_SHAPE = (3, 224, 224)  # torchvision's classification models
# Where the files go without --out: a folder of the system's temp dir, never the current folder (often a
# checkout, which a run should not change); the report prints each file's path.
DEFAULT_OUT = os.path.join(tempfile.gettempdir(), "minidp-explain")


def parse_shape(text: str) -> tuple:
    """'3,224,224' (or '3x224x224') -> (3, 224, 224); ValueError naming the text otherwise."""
    parts = [p for p in re.split(r"[,x\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--input-shape={text!r} must be positive integers separated by commas, e.g. 3,224,224 "
                         "(one sample, without the batch dimension)")
    return tuple(int(p) for p in parts)


def check_model_runs(spec: str, batch: int, shape) -> list:
    """Build the model here and run one forward on a batch of `shape`; returns (name, numel, bytes) per parameter.

    Fails fast, before any rank starts, with a message that names the model and the shape.
    """
    torch.manual_seed(0)
    model = record.build_model(spec)
    try:
        with torch.no_grad():
            record.scalar_loss(model(record.make_input(batch, shape, 0)))
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"MODEL={spec!r} does not accept an input of shape {(batch, *shape)} "
                         f"(--batch {batch}, --input-shape {','.join(map(str, shape))}): {first_line}") from None
    return [(n, p.numel(), p.numel() * p.element_size()) for n, p in model.named_parameters() if p.requires_grad]


def rank_start_method(threads: int):
    """"fork" when each rank runs one thread and nothing else decides; else None (minidp.launch's choice).

    Why: a forked rank starts with torch and the model's code already imported (a spawned one spends
    seconds of CPU importing them again), and a rank of one thread cannot wait on an OpenMP pool this
    process may have started (GNU OpenMP's pool does not survive a fork). $MINIDP_START_METHOD, a
    platform other than Linux (macOS makes spawn the default: system libraries there are not fork-safe),
    or CUDA initialised here (a forked child could not use it) leave it to launch().
    """
    if threads != 1 or os.environ.get("MINIDP_START_METHOD") or not sys.platform.startswith("linux"):
        return None
    return None if torch.cuda.is_initialized() else "fork"


def explain(model: str, world_size: int = 2, bucket_cap_mb: float | None = None, batch: int = 8,
            input_shape=None, find_unused: bool = False, steps: int = 3, out_dir: str = DEFAULT_OUT,
            progress=None, timeout: float = 600.0, zero_overlap=None) -> dict:
    """Run `steps` steps of `model` on `world_size` CPU ranks under minidp and torch DDP; return the report.

    Args:
        model: a torchvision model name, or "module:factory" (factory() returns the nn.Module).
        world_size: CPU ranks (processes). Default 2.
        bucket_cap_mb: DDP's bucket_cap_mb. Default None: DDP's default (25 MiB, first bucket 1 MiB).
        batch: samples per rank. Default 8.
        input_shape: one sample's shape. Default (3, 224, 224) for torchvision, required otherwise.
        find_unused: DDP's find_unused_parameters. Default False.
        steps: steps per engine (>= 2: the rebuilt buckets are used from step 2). Default 3.
        out_dir: where the PNG, trace and events go (created; checked writable before any rank starts).
            Default DEFAULT_OUT: minidp-explain in the system's temp dir.
        progress: callable(str) for progress lines. Default: print to stderr.
        timeout: seconds before the ranks are stopped. Default 600.
        zero_overlap: "end" or "interleaved": minidp's run uses ZeroRedundancyOptimizer(
            overlap_with_ddp=True) with hook_with_zero_step (every bucket stepped in the last
            bucket's hook) or hook_with_zero_step_interleaved (each as soon as its all-reduce is
            done); the report shows when each bucket was stepped (from step 3: steps must be >= 3).
            Default None: SGD stepped after backward.
    """
    check_int("world_size", world_size, 1)
    check_int("batch", batch, 1)
    check_int("steps", steps, 2)
    check_bool("find_unused", find_unused)
    if zero_overlap not in (None, "end", "interleaved"):
        raise ValueError(f"zero_overlap={zero_overlap!r} must be None, 'end' or 'interleaved'")
    if zero_overlap and steps < 3:
        raise ValueError(f"steps={steps}: zero_overlap=True needs 3 steps or more (ZeRO's overlap path updates "
                         "from the third step, once DDP's buckets are final)")
    if bucket_cap_mb is not None:
        check_number("bucket_cap_mb", bucket_cap_mb, positive=True)
    if input_shape is None and ":" in model:
        raise ValueError(f"MODEL={model!r}: give --input-shape (one sample's shape) for a module:factory model")
    shape = tuple(input_shape or DEFAULT_SHAPE)
    check_writable("out_dir", out_dir, folder=True)  # before minutes of ranks, not after
    progress = progress or (lambda text: print(f"explain: {text}", file=sys.stderr, flush=True))
    progress(f"building {model} and trying an input of shape {(batch, *shape)}")
    params = check_model_runs(model, batch, shape)
    cfg = {"model": model, "bucket_cap_mb": bucket_cap_mb, "find_unused": find_unused, "steps": steps,
           "zero_overlap": zero_overlap,
           "batch": batch, "input_shape": shape, "threads": max(1, (os.cpu_count() or 1) // world_size),
           "timeout": min(timeout, 300.0), "sys_path": [os.getcwd()] + sys.path}
    progress(f"starting {world_size} CPU rank(s): {steps} steps under minidp, then {steps} under torch DDP")
    with tempfile.TemporaryDirectory(prefix="minidp-explain-") as tmp:
        launch(record.worker, nprocs=world_size, args=(cfg, tmp), timeout=timeout,
               start_method=rank_start_method(cfg["threads"]))
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    report = summarize(cfg, params, world_size, ranks[0])
    report["files"] = write_files(report, ranks, out_dir, progress)
    return report


def summarize(cfg: dict, params: list, world_size: int, rank0: dict) -> dict:
    """The report: the model, the settings, and the construction and rebuilt phases (rank 0's view)."""
    ours, theirs = rank0["minidp"], rank0["ddp"]["steps"]
    last = cfg["steps"] - 1
    return {
        "model": cfg["model"], "world_size": world_size, "batch": cfg["batch"], "input_shape": list(cfg["input_shape"]),
        "bucket_cap_mb": cfg["bucket_cap_mb"], "find_unused": cfg["find_unused"],
        "zero_overlap": cfg["zero_overlap"],
        "parameters": sum(n for _, n, _ in params), "tensors": len(params),
        "mib": sum(b for _, _, b in params) / 2**20,
        "rebuilt": ours["plans"][last] != ours["plans"][0],
        "phases": [_phase("construction", 0, ours, theirs[0], params),
                   _phase("rebuilt", last, ours, theirs[last], params)],
        "params": [list(p) for p in params],  # (name, numel, bytes); the events file has the timelines
    }


def _phase(name: str, step: int, ours: dict, ddp_step: dict, params: list) -> dict:
    """One layout: per bucket its size, ends, and launch/done times in ms after backward began."""
    nbytes = {n: b for n, _, b in params}
    events = ours["events"][step]
    start = next(t for kind, t, _ in events if kind == "backward_start")
    end = next((t for kind, t, _ in events if kind == "backward_end"), None)
    returned = next((t for kind, t, _ in events if kind == "finalize_end"), None)  # all-reduces waited for
    ms = lambda t: None if t is None else (t - start) / 1e6  # noqa: E731 - a one-line unit conversion
    launch = {f["bucket"]: t for kind, t, f in events if kind == "launch"}
    done = {f["bucket"]: t for kind, t, f in events if kind == "done"}
    stepped = {int(name.split()[-1]): end for _, name, _, end in named_spans(events) if name.startswith("step")}
    rows = [{"index": b, "params": len(names), "mib": sum(nbytes[n] for n in names) / 2**20,
             "first": names[0], "last": names[-1], "launch_ms": ms(launch.get(b)), "done_ms": ms(done.get(b)),
             "zero_step_ms": ms(stepped.get(b)),
             "ddp_launch_ms": (ddp_step["launch"][b] - ddp_step["backward_start"]) / 1e6
             if b in ddp_step["launch"] else None}
            for b, names in enumerate(ours["plans"][step])]
    return {"name": name, "step": step + 1, "buckets": rows, "backward_ms": ms(end), "returned_ms": ms(returned),
            "ddp_returned_ms": (ddp_step["backward_end"] - ddp_step["backward_start"]) / 1e6,
            "same_as_ddp": ours["plans"][step] == ddp_step["plan"], "plan": ours["plans"][step],
            "ddp_plan": ddp_step["plan"]}


def write_files(report: dict, ranks: list, out_dir: str, progress) -> dict:
    """Timeline PNG and Perfetto trace of the last step (every rank), and the events for simulate."""
    from ..engine.timeline import write_chrome_trace
    from .plot import plot_timelines

    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, "explain_" + re.sub(r"[^\w.-]+", "_", report["model"]))
    events = {r: res["minidp"]["events"][-1] for r, res in enumerate(ranks)}
    files = {"png": stem + "_timeline.png", "trace": stem + "_trace.json", "events": stem + "_events.json"}
    cap = "default buckets" if report["bucket_cap_mb"] is None else f"bucket_cap_mb={report['bucket_cap_mb']:g}"
    try:
        import matplotlib  # noqa: F401 - optional: only the PNG needs it
    except ImportError:
        progress("matplotlib is not installed: no PNG (pip install matplotlib); the trace is written")
        files["png"] = None
    else:
        progress(f"drawing the timeline of step {len(ranks[0]['minidp']['events'])}")
        plot_timelines(files["png"], events, f"minidp, {report['model']}, world size {report['world_size']}, "
                       f"{cap}, {len(report['phases'][1]['buckets'])} buckets, CPU/gloo")
    write_chrome_trace(files["trace"], events)
    with open(files["events"], "w") as f:
        json.dump({key: report[key] for key in ("model", "world_size", "batch", "input_shape", "bucket_cap_mb",
                                                 "find_unused", "params")}
                  | {"plan": report["phases"][1]["plan"], "events": {str(r): e for r, e in events.items()}}, f)
    return files


def format_report(report: dict) -> str:
    """The terminal view of explain()'s report."""
    cap = ("default (25 MiB, first bucket 1 MiB)" if report["bucket_cap_mb"] is None
           else f"{report['bucket_cap_mb']:g} MiB")
    lines = [f"{report['model']}: {report['parameters']:,} parameters in {report['tensors']} tensors "
             f"({report['mib']:.2f} MiB), world size {report['world_size']} (CPU, gloo), "
             f"batch {report['batch']} x {tuple(report['input_shape'])}",
             f"bucket_cap_mb: {cap}; find_unused_parameters={report['find_unused']}", ""]
    for phase in report["phases"]:
        lines += _format_phase(phase, report) + [""]
    files = report.get("files")
    if files:
        lines.append(f"timeline of the last step: {files['png'] or '(no PNG: matplotlib missing)'}\n"
                     f"Perfetto trace (https://ui.perfetto.dev): "
                     f"{files['trace']}\nrecorded events (python -m minidp.simulate --events ...): {files['events']}")
    return "\n".join(lines).rstrip()


def _format_phase(phase: dict, report: dict) -> list:
    n = len(phase["buckets"])
    if phase["name"] == "construction":
        title = f"At construction (used in step {phase['step']}): {n} bucket{'s' * (n != 1)}"
    elif report["rebuilt"]:
        title = f"After the rebuild (step {phase['step']}): {n} bucket{'s' * (n != 1)}, in gradient-ready order"
    else:
        title = (f"No rebuild (step {phase['step']}): the construction buckets stay"
                 + (" (find_unused_parameters=True: DDP does not rebuild either)" if report["find_unused"] else ""))
    same = "yes" if phase["same_as_ddp"] else "NO"
    lines = [f"{title}. torch DDP builds the same buckets: {same}"]
    width = min(36, max([len("first parameter")] + [len(b[k]) for b in phase["buckets"] for k in ("first", "last")]))
    cut = lambda s: s if len(s) <= width else "..." + s[-(width - 3):]  # noqa: E731
    lines.append(f"  {'bucket':>6} {'params':>6} {'MiB':>8}  {'first parameter':<{width}}  "
                 f"{'last parameter':<{width}}  {'launched':>9} {'done':>9} {'DDP launched':>12}")
    zero = report.get("zero_overlap") and phase["name"] != "construction"
    if zero:
        lines[-1] += f" {'ZeRO step':>10}"
    fmt = lambda v: "" if v is None else f"{v:+.1f} ms"  # noqa: E731
    for b in phase["buckets"]:
        lines.append(f"  {b['index']:>6} {b['params']:>6} {b['mib']:>8.2f}  {cut(b['first']):<{width}}  "
                     f"{cut(b['last']):<{width}}  {fmt(b['launch_ms']):>9} {fmt(b['done_ms']):>9} "
                     f"{fmt(b['ddp_launch_ms']):>12}" + (f" {fmt(b['zero_step_ms']):>10}" if zero else ""))
    if zero:
        lines.append(f"  ZeRO step: when rank 0 finished stepping its part of the bucket (overlap_with_ddp=True, "
                     f"{report['zero_overlap']}; other ranks step theirs), inside loss.backward(); the timeline's "
                     "ZeRO lanes show the broadcasts")
    lines.append(f"  times: ms after backward began (rank 0). Backward done at {fmt(phase['backward_ms'])}; "
                 f"loss.backward() returned at {fmt(phase['returned_ms'])} "
                 f"(torch DDP: {fmt(phase['ddp_returned_ms'])})")
    if not phase["same_as_ddp"]:
        lines.append(f"  torch DDP's buckets: {phase['ddp_plan']}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minidp.explain", description=__doc__.split("\n")[0])
    p.add_argument("model", help="a torchvision model name (e.g. resnet18), or module:factory")
    p.add_argument("--world-size", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="default: DDP's (25, first bucket 1)")
    p.add_argument("--batch", type=int, default=8, help="samples per rank (default 8)")
    p.add_argument("--input-shape", default=None, help="one sample, e.g. 3,224,224 (default for torchvision)")
    p.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True")
    p.add_argument("--steps", type=int, default=3, help="steps per engine, >= 2 (default 3)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the PNG, trace and events (default: {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress stays on stderr)")
    p.add_argument("--zero-overlap", nargs="?", const="end", choices=["end", "interleaved"], default=None,
                   help="minidp steps ZeroRedundancyOptimizer inside backward: 'end' (default: hook_with_zero_step, "
                        "every bucket in the last bucket's hook) or 'interleaved' (each when its all-reduce is done)")
    args = p.parse_args(argv)
    try:
        shape = parse_shape(args.input_shape) if args.input_shape else None
        report = explain(args.model, args.world_size, args.bucket_cap_mb, args.batch, shape, args.find_unused,
                         args.steps, args.out, zero_overlap=args.zero_overlap)
    except (ValueError, TypeError) as e:  # one line, before any rank starts (argparse's usage would bury it)
        flags = {"world_size=": "--world-size=", "bucket_cap_mb=": "--bucket-cap-mb=", "batch=": "--batch=",
                 "steps=": "--steps=", "out_dir=": "--out="}
        message = str(e)
        for name, flag in flags.items():
            message = message.replace(name, flag)
        p.exit(2, f"{p.prog}: error: {message}\n")
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0
