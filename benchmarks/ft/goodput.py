"""GOODPUT under failures: minidp.ft, the restart path, and torchft's DDP, side by side in one run.

    python benchmarks/ft/goodput.py --modes restart,torchft             # 3 replicas, 60 s runs, 6 failures
    python benchmarks/ft/goodput.py --repeats 3 --json /tmp/goodput.json
    python benchmarks/ft/goodput.py --quick                             # 10 s runs, one kill: a smoke run

Every mode trains workload.py's model on its data and meets the same failure schedule
(workload.make_schedule: exception, kill, hang at the same wall times since the run's start, on the
same replicas), on this machine, one mode at a time. Per repeat: first a failure-free run of each
mode (same duration), then the failure run of each; a repeat draws a new schedule (seed + repeat).
The modes (each `run(schedule, duration_s, replicas, log_dir, run_start, **kw)` writes the event
logs of event_log.py; goodput_metrics.py reads them):
  ft             minidp.ft: benchmarks/ft/minidp_side.py's runner (skipped while that file is missing)
  restart        `python -m minidp.run --max-restarts` with a checkpoint every --every steps (restart_side.py)
  torchft        torchft 0.2.0's DDP as released, a dead replica restarted alone (torchft_side.py)
  torchft-fixed  the same with its comm hook's error path mended (torchft_ddp_fix.py): in 0.2.0 a
                 failure's survivors die in their backward too
torchft comes from the optional extra: `pip install -e '.[ft-bench]'`; without it its modes are skipped.
Printed: committed steps/s (distinct step indices over the run's wall time), goodput (that over the
same mode's failure-free rate, per repeat), the same goodput in replica-steps (a step committed by
2 live replicas of 3 brings 2 batches, not 3), kill -> next commit and restart -> first commit
(median and spread, pooled over the repeats). --json writes every run's numbers; nothing else is written.
On a machine with fewer cores than replicas need, a step of fewer live replicas runs faster: the
step goodput of the modes that go on without a dead replica is flattered; read the replica-step one.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import goodput_metrics as gm  # noqa: E402
from workload import make_schedule  # noqa: E402

# mode -> (runner module, extra keyword arguments to its run())
MODES = {"ft": ("minidp_side", {}), "restart": ("restart_side", {}), "torchft": ("torchft_side", {}),
         "torchft-fixed": ("torchft_side", {"fix_dummy_work": True})}
PROGRESS_S = 15.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="ft,restart,torchft,torchft-fixed",
                   help=f"comma-separated, of {', '.join(MODES)} (default: all)")
    p.add_argument("--replicas", type=int, default=3, help="replicas (ranks) per run (default 3)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per run (default 60)")
    p.add_argument("--failures", type=int, default=6, help="failures in the failure run (default 6)")
    p.add_argument("--gap", type=float, default=5.0, help="least seconds between two failures (default 5)")
    p.add_argument("--hang-s", type=float, default=6.0, help="how long a hang sleeps (default 6)")
    p.add_argument("--hang-timeout", type=float, default=3.0,
                   help="collective timeout: the restart path's gloo, torchft's gloo and Manager (default 3)")
    p.add_argument("--every", type=int, default=20, help="restart path: steps between checkpoints (default 20)")
    p.add_argument("--repeats", type=int, default=1, help="repeats, each with its own schedule (default 1)")
    p.add_argument("--seed", type=int, default=0, help="the first repeat's schedule seed (default 0)")
    p.add_argument("--json", default=None, help="write every run's numbers here (default: nowhere)")
    p.add_argument("--log-dir", default=None, help="keep the event logs here (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="10 s runs, one kill at 4-6 s: a smoke run")
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.failures = 10.0, 1
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in a.modes if m not in MODES]
    if unknown:
        p.error(f"--modes {','.join(unknown)}: unknown; pick from {', '.join(MODES)}")
    for name in ("replicas", "duration", "repeats"):
        if getattr(a, name) <= 0:
            p.error(f"--{name} {getattr(a, name)} must be > 0")
    return a


def schedule_for(a: argparse.Namespace, rep: int) -> list:
    """The failure schedule of repeat `rep` (make_schedule, seed + rep); --quick: one kill at 40-60% of the run."""
    if a.quick:
        return make_schedule(1, a.duration * 0.6, a.replicas, seed=a.seed + rep, kinds=("kill",),
                             start_s=a.duration * 0.4)
    # --gap may push the last events past the end: they are dropped (the table counts the events that fired)
    return [e for e in make_schedule(a.failures, a.duration, a.replicas, seed=a.seed + rep, gap_s=a.gap)
            if e["at_s"] < a.duration]


def load_runners(modes):
    """{mode: (run function, extra kwargs)} for the modes that can run here; prints why the others cannot."""
    runners = {}
    for mode in modes:
        module, extra = MODES[mode]
        try:
            if module == "torchft_side":
                os.environ.setdefault("RUST_LOG", "warn")  # as torchft_side.run sets it, before the import
                importlib.import_module("torchft.coordination")  # imported now: not inside a run's clock
            runners[mode] = (importlib.import_module(module).run, extra)
        except ModuleNotFoundError as exc:
            why = ("benchmarks/ft/minidp_side.py is not there yet" if module == "minidp_side" and
                   exc.name == "minidp_side" else f"{exc} (torchft: pip install -e '.[ft-bench]')")
            print(f"goodput: skipping mode {mode}: {why}", flush=True)
    return runners


def _progress(label: str, log_dir: str, run_start: float, stop: threading.Event) -> None:
    """Print the run's committed steps and process starts every PROGRESS_S seconds until `stop`."""
    while not stop.wait(PROGRESS_S):
        try:
            runs = gm.read_logs(log_dir)
        except ValueError:  # a line being written: next time
            continue
        steps = len({s for r in runs for _, s in r["commits"]})
        print(f"  {label}: {time.time() - run_start:5.1f} s, {steps} steps committed, "
              f"{len(runs)} process start(s)", flush=True)


def run_one(mode: str, runner, extra: dict, schedule, a, log_dir: str, label: str) -> dict:
    """One run of one mode: its summary (goodput_metrics.summarize without a baseline), or its error."""
    run_fn, kw = runner, {**extra, "hang_s": a.hang_s, "hang_timeout": a.hang_timeout, "every": a.every}
    os.makedirs(log_dir, exist_ok=True)
    stop = threading.Event()
    run_start = time.time()
    watcher = threading.Thread(target=_progress, args=(label, log_dir, run_start, stop), daemon=True)
    watcher.start()
    error = None
    try:
        run_fn(schedule, a.duration, a.replicas, log_dir, run_start, **kw)
    except Exception as exc:  # one mode's failure is a result too: the others still run
        error = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
    summary = gm.summarize(gm.read_logs(log_dir), schedule, run_start, a.duration)
    summary.update(mode=mode, run_start=run_start, wall_s=time.time() - run_start, error=error, log_dir=log_dir)
    print(f"  {label}: {summary['committed_steps_per_s']:.2f} steps/s, {summary['incarnations']} process "
          f"start(s), {summary['failures_fired']} of {summary['failures_scheduled']} failure(s) fired, "
          f"{summary['wall_s']:.0f} s wall" + (f"; FAILED: {error}" if error else ""), flush=True)
    return summary


def _fmt(s: dict) -> str:
    """A spread as 'median [lo-hi] (n)', with the count of missing values."""
    if s["median"] is None:
        return f"- ({s['missing']} none)" if s["missing"] else "-"
    out = f"{s['median']:.2f} [{s['lo']:.2f}-{s['hi']:.2f}] n={s['n']}"
    return out + (f", {s['missing']} none" if s["missing"] else "")


def table(results: list, modes) -> tuple:
    """The printed table and its rows: per mode, rates and goodput over the repeats, recovery times pooled."""
    rows, lines = {}, []
    head = ("mode", "free steps/s", "fail steps/s", "goodput", "goodput (replica-steps)", "kill->commit s",
            "failure->commit s", "restart->commit s", "fired", "starts")
    lines.append(" | ".join(head))
    lines.append(" | ".join("---" for _ in head))
    for mode in modes:
        free = [r for r in results if r["mode"] == mode and r["kind"] == "free"]
        fail = [r for r in results if r["mode"] == mode and r["kind"] == "fail"]
        if not free:
            continue
        pool = {k: [v for r in fail for v in r[k]] for k in ("kill_to_commit_s", "failure_to_commit_s",
                                                              "restart_to_commit_s")}
        row = {"free_steps_per_s": gm.spread([r["committed_steps_per_s"] for r in free]),
               "fail_steps_per_s": gm.spread([r["committed_steps_per_s"] for r in fail]),
               "goodput": gm.spread([r["goodput"] for r in fail]),
               "replica_step_goodput": gm.spread([r.get("replica_step_goodput") for r in fail]),
               **{k: gm.spread(v) for k, v in pool.items()}}
        row["failures_fired"] = sum(r["failures_fired"] for r in fail)
        row["failures_scheduled"] = sum(r["failures_scheduled"] for r in fail)
        row["process_starts"] = sum(r["incarnations"] for r in fail)
        rows[mode] = row
        cells = [_fmt(row[k]) for k in ("free_steps_per_s", "fail_steps_per_s", "goodput", "replica_step_goodput",
                                        "kill_to_commit_s", "failure_to_commit_s", "restart_to_commit_s")]
        lines.append(" | ".join([mode, *cells, f"{row['failures_fired']}/{row['failures_scheduled']}",
                                 str(row["process_starts"])]))
    return "\n".join(lines), rows


def _machine() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    import torch
    versions = {"torch": torch.__version__}
    try:
        from importlib.metadata import version

        import torchft  # noqa: F401
        versions["torchft"] = version("torchft")
    except ImportError:
        pass
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, **versions}


def main(argv=None) -> int:
    a = parse_args(argv)
    runners = load_runners(a.modes)
    if not runners:
        print("goodput: no mode can run here", flush=True)
        return 1
    modes = [m for m in a.modes if m in runners]
    root = a.log_dir or tempfile.mkdtemp(prefix="ft-goodput-")
    results, schedules = [], []
    print(f"goodput: modes {', '.join(modes)}; {a.replicas} replicas, {a.duration:g} s runs, {a.failures} "
          f"failure(s), hang {a.hang_s:g} s, collective timeout {a.hang_timeout:g} s, checkpoint every "
          f"{a.every} steps, {a.repeats} repeat(s)", flush=True)
    try:
        for rep in range(a.repeats):
            schedule = schedule_for(a, rep)
            schedules.append(schedule)
            print(f"repeat {rep + 1}/{a.repeats}: schedule " + ", ".join(
                f"{e['kind']}@{e['at_s']:.1f}s r{e['replica']}" for e in schedule), flush=True)
            free = {}
            for kind, sched in (("free", []), ("fail", schedule)):
                for mode in modes:
                    label = f"{mode} {kind} (repeat {rep + 1})"
                    print(f"{label}: {a.duration:g} s", flush=True)
                    run_fn, extra = runners[mode]
                    s = run_one(mode, run_fn, extra, sched, a, os.path.join(root, f"r{rep}", mode, kind), label)
                    s.update(kind=kind, repeat=rep)
                    if kind == "free":
                        free[mode] = s
                    elif free[mode]["committed_steps_per_s"]:
                        s["goodput"] = s["committed_steps_per_s"] / free[mode]["committed_steps_per_s"]
                        s["replica_step_goodput"] = (s["committed_replica_steps_per_s"]
                                                     / free[mode]["committed_replica_steps_per_s"])
                    results.append(s)
    finally:
        if a.log_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text, rows = table(results, modes)
    print("\n" + text)
    print("\n(median [p10-p90 from 10 values, else min-max] n=values; goodput = fail / free steps/s of the same"
          " mode and repeat; replica-steps = (step, replica) pairs committed, each one replica's batch; 'none' ="
          " no commit before the run's end; fired = failures that happened of those"
          " scheduled; starts = processes started in the failure runs)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": _machine(), "args": vars(a), "schedules": schedules, "runs": results,
                       "table": rows}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
