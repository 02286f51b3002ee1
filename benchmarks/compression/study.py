"""The gradient-compression study: steps and time to a target validation loss, per method, on real text.

    python benchmarks/compression/study.py                      # every phase (25-30 min on 2 idle cores)
    python benchmarks/compression/study.py --phases sweep,seeds # only some phases; rows are appended to RUNS
    python benchmarks/compression/study.py --phases report      # rebuild the study JSON and table from RUNS
    python benchmarks/compression/study.py --quick --out /tmp/c # tiny sizes, seconds (the smoke test)
    python -m minidp.simulate --study runs/compression/compression_study.json   # time to target at scale

Everything goes to --out (RUNS = OUT/compression_runs.jsonl, the study JSON, the network and probe files),
by default runs/compression/ in the checkout, which git ignores: a rerun leaves the tree clean. The recorded
study that the README's `python -m minidp.simulate --study` reads is benchmarks/results/ (--out
benchmarks/results to add to it on purpose). Each run prints one line as it finishes.

Task (compression_task.py): a character-level MLP (16 characters of context, 313 k
parameters) on the license texts shipped in torch's wheel, world size 2 on CPU (gloo), global batch
128, SGD momentum 0.9 at a constant lr after a 10-step warm-up (exact steps, before every method).
Adam (exact, DDP), DeMo and 1-bit Adam bring their own optimizer, at a constant lr after the same linear
warm-up of the lr; DeMo communicates from the first step, 1-bit Adam exactly until --freeze-step.
Phases, each a launch of its own:
  sweep     every method at each --lrs value (Adam, DeMo, 1-bit Adam: each --adam-lrs value), seed 0
            (world 2); a method's lr is the one with the fewest steps to --target (ties: the lowest final
            validation loss)
  seeds     the other --seeds at each method's lr (world 2)
  cost      world size 1: each method's mean step against a step with no communication ("noop": DDP
            with a transport that sends nothing): what compress, decompress and memory cost on this
            machine; --repeats launches, each running every method twice, interleaved
  payload   one rank: what each more rank's payload adds to a method's aggregate (decompress and add:
            task.payload_cost), which the cost phase's world size 1 sees once, and 1-bit Adam's compression
            (task.onebit_compression_cost: at world size 1 it compresses nothing); to
            OUT/compression_payload.json
  validate  world sizes 2 and 4 (the same global batch: 64 and 32 per rank), seed 0, each method until
            it reaches the target (its measured time to target), and before and after them the step with
            no communication (the compute the simulator's --shared-cores validation takes) and the
            probes: that step with one all-reduce of PROBE_BYTES each (the link as a step meets it);
            --repeats launches per world size, alternating 2 and 4, the methods' order reversed every
            other launch
  network   gloo all-reduce sweeps at world sizes 2 and 4 (--repeats launches each, the median per size),
            fitted to alpha-beta links (network.fit_ring)
  probe     one process: the share of exact SGD's gradients that TopK 1% and rank 1 / rank 4 keep
  report    OUT/compression_study.json, the tables (RESULTS.md between markers), the sanity checks
Each invocation tags its rows with a batch (its start time); the report reads the validation and the
costs from the newest batch that measured them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)
# benchmarks/ is not a package: this folder and shared/ (results_md) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]
DEFAULT_OUT = os.path.join(os.path.dirname(BENCHMARKS), "runs", "compression")  # git ignores runs/

import compression_task as task  # noqa: E402
import minidp  # noqa: E402

PHASES = ("sweep", "seeds", "cost", "payload", "validate", "network", "probe", "report")
FULL = dict(steps=400, eval_every=10, global_batch=128, val_windows=4096, target=1.2, start_iter=task.START_ITER,
            lrs="0.05,0.1,0.2", adam_lrs="0.001,0.003,0.01", freeze_step=40, seeds=3, cost_steps=60, repeats=5)
QUICK = dict(steps=24, eval_every=4, global_batch=16, val_windows=256, target=4.3, start_iter=4, lrs="0.1,0.4",
             adam_lrs="0.003", freeze_step=6, seeds=2, cost_steps=10, repeats=1)
PROBE_BYTES = (4096, 65536, 1048576, 4194304)  # the validation's in-step all-reduce probes: 4 KiB ... 4 MiB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"tiny sizes: {QUICK}")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder of RUNS and the study JSON (default: runs/compression "
                   "in the checkout; benchmarks/results holds the recorded study)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of " + ",".join(PHASES))
    p.add_argument("--methods", default=",".join(task.METHODS), help="comma-separated subset of: "
                   + ", ".join(task.METHODS).replace("%", "%%"))  # argparse %-formats help: "TopK 1%"
    p.add_argument("--results-md", default=None, help="markdown file for the table (default: none)")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None, help=f"default {value}")
    args = p.parse_args(argv)
    args.batch = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")  # tags its rows
    for name in FULL:
        if getattr(args, name) is None:
            setattr(args, name, (QUICK if args.quick else FULL)[name])
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    args.methods = [x.strip() for x in args.methods.split(",") if x.strip()]
    if not args.phases or any(x not in PHASES for x in args.phases):
        p.error(f"--phases {args.phases}: choose from {list(PHASES)}")
    unknown = [m for m in args.methods if m not in task.METHODS]
    if unknown or not args.methods:
        p.error(f"--methods: unknown {unknown}; choose from {list(task.METHODS)}")
    for name in ("lrs", "adam_lrs"):
        try:
            setattr(args, name, [float(x) for x in getattr(args, name).split(",")])
        except ValueError:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: give comma-separated numbers, e.g. "
                    f"{FULL[name]}")
    for name in ("steps", "eval_every", "global_batch", "seeds", "cost_steps", "freeze_step", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.global_batch % 4:
        p.error(f"--global-batch {args.global_batch} must be a multiple of 4 (world sizes 1, 2 and 4 split it)")
    return args


def config(args) -> dict:
    return {k: getattr(args, k) for k in ("steps", "eval_every", "global_batch", "val_windows", "target",
                                          "start_iter", "freeze_step")}


def lrs_of(method: str, args) -> list:
    """The lrs swept for `method`: --adam-lrs for those with their own optimizer (Adam, DeMo, 1-bit Adam)."""
    return args.adam_lrs if task.METHODS[method] in task.OWN_OPTIMIZER else args.lrs


def runs_path(args) -> str:
    return os.path.join(args.out, "compression_runs.jsonl")


def read_runs(path: str) -> list:
    """Every row of RUNS, in the order written (a rerun's rows come after, and win where a key repeats)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chosen_lrs(rows: list) -> dict:
    """Per method, the swept lr with the fewest steps to the target (ties and never-reached: lowest final loss)."""
    best = {}
    for r in rows:
        if r["phase"] != "sweep":
            continue
        final = r["final_val_loss"] if r["final_val_loss"] == r["final_val_loss"] else float("inf")  # nan: diverged
        key = (r["steps_to_target"] or float("inf"), final)
        if r["method"] not in best or key < best[r["method"]][0]:
            best[r["method"]] = (key, r["lr"])
    return {m: lr for m, (_, lr) in best.items()}


def run_line(phase: str, done: int, total: int, row: dict, wall_s: float) -> str:
    """One finished run, as printed: which, how many steps to the target, how long."""
    reached = f"{row['steps_to_target']} steps to target" if row["steps_to_target"] else (
        f"target not reached in {row['steps_run']} steps")
    return (f"{phase} {done}/{total}: {row['method']} lr {row['lr']:g} seed {row['seed']}: {reached}, "
            f"final val loss {row['final_val_loss']:.3f}, {wall_s:.0f} s")


def _worker(local_rank: int, jobs: list, cfg: dict, phase: str, path: str, tags: dict) -> None:
    import torch

    import compression_run

    minidp.init(backend="gloo")
    torch.set_num_threads(1)  # ranks share 2 cores
    done, last = 0, time.perf_counter()

    def log(row):  # rank 0, after each run: the row to RUNS, a line to the terminal
        nonlocal done, last
        with open(path, "a") as f:
            f.write(json.dumps({"phase": phase, **tags, **row}) + "\n")
        done, now = done + 1, time.perf_counter()
        print(run_line(phase, done, len(jobs), row, now - last), flush=True)
        last = now
    compression_run.run_jobs(jobs, cfg, log)
    minidp.shutdown()


def _payload_worker(local_rank: int, methods: list, path: str) -> None:
    """The payload phase's one rank: per method what one more rank's payload costs its aggregate, and 1-bit
    Adam's compression, added to what `path` holds (methods measured before keep their value)."""
    import torch

    minidp.init(backend="gloo")
    torch.set_num_threads(1)  # as a rank's
    found = {"per_payload_s": {}}
    if os.path.exists(path):
        with open(path) as f:
            found.update(json.load(f))
    for m in methods:
        found["per_payload_s"][m] = task.payload_cost(m, [b // 4 for b in task.BUCKET_BYTES])
    shapes = [tuple(p.shape) for p in task.CharMLP(task.Text.load(val_windows=16).vocab).parameters()]
    found["onebit_compression_s"] = task.onebit_compression_cost(shapes)
    with open(path, "w") as f:
        json.dump(found, f, indent=1)
    minidp.shutdown()


def launch(phase: str, jobs: list, world: int, cfg: dict, args, repeat: int = 0) -> None:
    print(f"{phase}: {len(jobs)} run(s) at world size {world}, rows to {runs_path(args)}", flush=True)
    tags = {"batch": args.batch, "repeat": repeat}
    minidp.launch(_worker, nprocs=world, args=(jobs, cfg, phase, runs_path(args), tags))


def run_phase(phase: str, args) -> None:
    cfg, seeds = config(args), range(args.seeds)
    if phase == "sweep":
        launch(phase, [(m, lr, 0) for m in args.methods for lr in lrs_of(m, args)], 2, cfg, args)
        return
    if phase == "probe":  # one process, no launch: what TopK and low rank keep of exact SGD's gradients
        energy = task.gradient_energy(task.Text.load())
        with open(os.path.join(args.out, "compression_probe.json"), "w") as f:
            json.dump(energy, f, indent=1)
        for step, row in energy.items():
            print(f"step {step}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        return
    if phase == "payload":  # one process: aggregate one payload against five; 1-bit Adam's compression
        path = os.path.join(args.out, "compression_payload.json")
        minidp.launch(_payload_worker, nprocs=1, args=(args.methods, path))
        with open(path) as f:
            found = json.load(f)
        for m, seconds in found["per_payload_s"].items():
            print(f"payload: {m}: {1e3 * seconds:.3f} ms per more rank", flush=True)
        print(f"payload: 1-bit Adam's compression: {1e3 * found['onebit_compression_s']:.3f} ms a step", flush=True)
        return
    if phase == "network":
        from compression_report import measure_links

        measure_links(os.path.join(args.out, "compression_network.json"), quick=args.quick, repeats=args.repeats)
        return
    lrs = chosen_lrs(read_runs(runs_path(args)))
    missing = [m for m in args.methods if m not in lrs]
    if missing:
        raise SystemExit(f"phase {phase}: no sweep rows for {missing} in {runs_path(args)}: run --phases sweep first")
    if phase == "seeds":
        launch(phase, [(m, lrs[m], s) for s in seeds[1:] for m in args.methods], 2, cfg, args)
    elif phase == "cost":
        # one rank with the study's per-rank batch (world size 2's), so that compute_s["1"] is a rank's step
        cost_cfg = {**cfg, "steps": args.start_iter + args.cost_steps, "eval_every": 10 ** 9, "target": -1.0,
                    "global_batch": args.global_batch // 2}
        jobs = [(m, lrs.get(m, 0.1), 0) for m in ["noop", *args.methods]]
        for repeat in range(args.repeats):  # twice in each, interleaved: the machine's load falls on all alike
            launch(phase, jobs + jobs, 1, cost_cfg, args, repeat)
    elif phase == "validate":
        # The compute (no communication) and the probes before and after the runs, in the same launch: the
        # load others put on the machine then falls on them and the runs alike.
        short = {"steps": args.start_iter + args.cost_steps, "eval_every": 10 ** 9, "target": -1.0}
        noop = ("noop", 0.1, 0, short)
        probes = [("probe", 0.1, 0, {**short, "probe_bytes": b}) for b in PROBE_BYTES]
        for repeat in range(args.repeats):
            methods = [(m, lrs[m], 0) for m in args.methods][::-1 if repeat % 2 else 1]
            for world in (2, 4):
                launch(phase, [noop, *probes, *methods, *probes[::-1], noop], world, {**cfg, "stop_at_target": True},
                       args, repeat)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for phase in args.phases:
        if phase == "report":
            from compression_report import report

            report(args, read_runs(runs_path(args)), chosen_lrs(read_runs(runs_path(args))))
        else:
            run_phase(phase, args)


if __name__ == "__main__":
    main()
