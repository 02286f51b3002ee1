"""One command for a machine with one NVIDIA GPU and no network: minidp's GPU paths, checked and timed.

    PYTHONPATH=. python benchmarks/gpu/gpu_check.py                  # about 3-5 minutes on one GPU (at most 8)
    PYTHONPATH=. python benchmarks/gpu/gpu_check.py --quick          # the MLP only, fewer steps
    PYTHONPATH=. python benchmarks/gpu/gpu_check.py --device cpu --quick --results-md ''   # dry run without a GPU

Checks, each in fresh processes on a GPU (on the CPU, those of one world size share a launch; the checks
themselves: checks.py):
  engine       world size 1 on NCCL: minidp.DDP(transport=TorchDist()) against torch DDP on the MLP and
               ResNet-18 (the default path issues no collective at world size 1), bitwise; step ratio.
  status       world size 1 on NCCL: the default step's host syncs under torch.cuda.set_sync_debug_mode
               (2 in 2 steps expected: the NaN read before 3bb5da5, see checks.check_status) and its time,
               as built and after engine.failures.status_on_host (which moves only find_unused_parameters'
               use-count all-reduce to a gloo group: a default step has none).
  cupy         world size 1 (NCCL refuses two ranks on one GPU): CupyNccl bitwise against torch's NCCL,
               minidp.DDP(transport=CupyNccl()) against torch DDP, every compressor over it.
  compressors  two processes sharing the GPU over gloo with CUDA tensors: every compressor with error
               feedback, ranks equal, bytes as declared, against the same run on CPU tensors.
  world2       two processes sharing the GPU over gloo: minidp.DDP against torch DDP, FP16() against
               torch's fp16_compress_hook, SyncBatchNorm beside a compression hook.
               (Both gloo checks use the quick models for a few steps: results, not speed, over gloo.)
Every row counts the collectives its minidp run issued (collective_count.py); a row that issued none
fails. Prints one verdict line per check and a table, and writes the table into --results-md between
markers (default: nowhere; `--results-md benchmarks/RESULTS.md` updates the recorded one). Needs
torch, CuPy for `cupy` (skipped without it), torchvision for ResNet-18 (skipped without it). Exit
status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import minidp  # noqa: E402
from checks import CHECKS, COMPRESSORS, row  # noqa: E402, F401 - COMPRESSORS: the tests count its rows
from collective_count import CollectiveCounter  # noqa: E402 - benchmarks/ is not a package
from results_md import write_section  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on gloo "
                   "(no GPU needed; the CuPy rows are skipped)")
    p.add_argument("--quick", action="store_true", help="the MLP only, few steps")
    p.add_argument("--steps", type=int, default=None, help="timed steps per engine (default 30, quick 4)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per check before it is killed")
    p.add_argument("--results-md", default="",
                   help="the RESULTS.md to write the table into (default '': none; "
                        "benchmarks/RESULTS.md to update the recorded one)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset (default: all)")
    p.add_argument("--share-processes", action=argparse.BooleanOptionalAction, default=None,
                   help="run the checks of one world size in one launch (default: on the CPU only)")
    args = p.parse_args(argv)
    args.checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    if not args.checks or any(c not in CHECKS for c in args.checks):
        p.error(f"--checks {','.join(args.checks)!r}: choose from {','.join(CHECKS)}")
    if args.share_processes is None:
        args.share_processes = args.device == "cpu"
    if args.steps is None:
        args.steps = 4 if args.quick else 30
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                "use --device cpu for a dry run")
    return args


def judged(rows: list, world: int) -> list:
    """Each row with its world size; a row that passed without issuing a collective fails (it checked nothing)."""
    for r in rows:
        r["world"] = world
        if r["result"] == "ok" and r["collectives"] < 1:
            r["result"], r["detail"] = "FAIL", "issued no collective: checked nothing. " + r["detail"]
    return rows


def _worker(local_rank: int, names: list, args, folder: str) -> None:
    """Run `names` (checks of one world size) one after another in this process; each writes its rows file."""
    counter = CollectiveCounter().install()  # first: every transport and model made below is counted
    procs = CHECKS[names[0]][1]
    minidp.init(backend="nccl" if args.device == "cuda" and procs == 1 else "gloo", timeout=120)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * procs)))
    for name in names:
        began = time.time()
        rows = CHECKS[name][0](args, counter)  # an exception ends the launch: the caller reruns what is left
        if dist.get_rank() == 0:
            with open(os.path.join(folder, f"{name}.json"), "w") as f:
                json.dump({"rows": judged(rows, procs), "seconds": time.time() - began}, f)
    minidp.shutdown()


def run_checks(names: list, args) -> dict:
    """{name: (rows, seconds)} for checks of one world size, run in one launch (fresh processes).

    A check that crashed or timed out becomes a FAIL row, not a stop; the checks after it in a shared
    launch are run again, each in fresh processes of its own."""
    procs = CHECKS[names[0]][1]
    found = {}
    with tempfile.TemporaryDirectory(prefix="minidp-gpu-check-") as folder:
        began = time.time()
        try:
            minidp.launch(_worker, procs, args=(names, args, folder), timeout=args.timeout * len(names))
            error = None
        except Exception as exc:  # noqa: BLE001 - reported in the table
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        for name in names:
            path = os.path.join(folder, f"{name}.json")
            if os.path.exists(path):
                with open(path) as f:
                    done = json.load(f)
                found[name] = done["rows"], done["seconds"]
    if error is not None and len(names) == 1:
        found[names[0]] = judged([row(names[0], False, error)], procs), time.time() - began
    elif error is not None:  # rerun each check left without rows alone, so that a failure is its own
        for name in [n for n in names if n not in found]:
            found.update(run_checks([name], args))
    return found


def table(rows: list, header: str) -> str:
    lines = [header, "", "| check | world | collectives | result | detail |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['check']} | {r['world']} | {r['collectives']} | {r['result']} | {r['detail']} |" for r in rows]
    return "\n".join(lines)


def verdict(name: str, rows: list, seconds: float) -> str:
    """One line per check: FAIL if a row failed, ok if one passed and none failed, else skipped."""
    results = {r["result"] for r in rows}
    word = "FAIL" if "FAIL" in results else ("ok" if "ok" in results else "skipped")
    return (f"check {name}: {word} ({len(rows)} rows, {sum(r['collectives'] for r in rows)} collectives, "
            f"{seconds:.0f} s)")


def environment() -> str:
    parts = [f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name(0))
    try:
        import cupy
        parts.append(f"cupy {cupy.__version__}")
    except ImportError:
        parts.append("no cupy")
    return ", ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    start, rows = time.time(), []
    # Checks of one world size share a launch on the CPU (a dry run: what matters there is that every
    # path runs); on a GPU each runs in fresh processes, so one check's CUDA state cannot touch the next.
    sizes = sorted({CHECKS[n][1] for n in args.checks})
    groups = ([[n for n in args.checks if CHECKS[n][1] == procs] for procs in sizes] if args.share_processes
              else [[n] for n in args.checks])
    found = {}
    for names in groups:
        try:
            found.update(run_checks(names, args))
        except Exception:  # noqa: BLE001 - never lose the rows gathered so far
            for name in names:
                found.setdefault(name, (judged([row(name, False, traceback.format_exc().strip().splitlines()[-1])],
                                               CHECKS[name][1]), 0.0))
    for name in args.checks:
        checked, seconds = found[name]
        print(verdict(name, checked, seconds), flush=True)
        rows += checked
    text = table(rows, f"GPU check ({environment()}; {time.time() - start:.0f} s; "
                       f"{'quick' if args.quick else 'full'}, {args.steps} timed steps)")
    print(text)
    if args.results_md:
        write_section(args.results_md, f"gpu_check {args.device}", text)
    return 1 if any(r["result"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
