"""`python -m minidp.simulate --study FILE`: the time-to-target table and plot (time_to_target.py's model),
and the model against this machine: the compression study's validation runs, predicted.

    python -m minidp.simulate --study benchmarks/results/compression_study.json --validate

The study (benchmarks/compression/study.py, phase validate) runs each method to the target at world sizes
2 and 4 on the machine's shared cores, several launches; each run records what its launch measured beside
it (the compute, the in-step link, the sync). validate() predicts every run with time_to_target.py's model
from those measurements and compares; RESULTS.md ("Time to target at scale", Validation) reads the table.
"""
from __future__ import annotations

import statistics

from ..validate import check_number
from . import time_to_target as ttt
from .network import Link, Network


def validate(study: dict) -> list:
    """Predicted against measured time to target where the study measured it (world sizes 2 and 4 here).

    measured[W]["runs"] lists runs of the method at W ranks (seed 0, one per launch), each with
    time_to_target_s, its median step_s, compute_s: the step with no communication measured in the
    same launch (all W ranks computing at once on the shared cores), which carries that launch's load,
    and where recorded its own steps_to_target, link: the ring link fitted to all-reduces issued inside
    that launch's training steps, and sync_s: what such an all-reduce cost beyond the gloo link fitted at
    W (study["network"][W], back-to-back all-reduces). Each run is predicted for its own steps (else the
    median over the study's seeds) from its compute, the method's cost scaled by the same slowdown and
    nothing overlapping (shared cores), twice: (a) on its in-step link (else the network's), and (b) on
    the network's link plus sync_s once a step (where recorded: else None). A cost slows down as the
    compute of the same per-rank batch does (study["compute_s"]["1@B"], B = global_batch / W, where
    measured: at 4 ranks the batch halves but a compressor's work does not). Returns rows of (W, method,
    predicted_s, measured_s, error, lowest error, highest error, predicted_step_s, measured_step_s,
    step_error, runs, (b)'s error, lowest, highest): medians over the runs, errors as predicted / measured - 1.
    """
    def predict(run, w, in_step: bool):
        link = Link(**(run.get("link", study["network"][w]) if in_step else study["network"][w]))
        net = Network(link, link, ranks_per_node=int(w), shared_cores=True)
        alone = study["compute_s"].get(f"1@{study.get('global_batch', 0) // int(w)}")  # that per-rank batch, alone
        kwargs = dict(compute_s=run["compute_s"], sync_s=0.0 if in_step else run["sync_s"], compute_1_s=alone)
        steps = [run["steps_to_target"]] if run.get("steps_to_target") else None
        return (ttt.summarize(ttt.time_to_target(study, name, int(w), net, steps=steps, **kwargs))[0],
                ttt.step_time(study, name, int(w), net, **kwargs))

    med, rows = statistics.median, []
    for w in sorted(study["network"], key=int):
        for name, method in study["methods"].items():
            runs = [r for r in method.get("measured", {}).get(w, {}).get("runs", []) if r["time_to_target_s"]]
            if not runs:
                continue
            pred, step = zip(*(predict(r, w, in_step=True) for r in runs))
            errors = [p / r["time_to_target_s"] - 1 for p, r in zip(pred, runs)]
            synced = [predict(r, w, in_step=False)[0] / r["time_to_target_s"] - 1 for r in runs if "sync_s" in r]
            rows.append((int(w), name, med(pred), med(r["time_to_target_s"] for r in runs), med(errors), min(errors),
                         max(errors), med(step), med(r["step_s"] for r in runs),
                         med(p / r["step_s"] - 1 for p, r in zip(step, runs)), len(runs),
                         *((med(synced), min(synced), max(synced)) if synced else (None, None, None))))
    return rows


def format_validation(rows: list) -> str:
    w = max([16] + [len(r[1]) for r in rows])
    lines = [f"{'world':>5} {'method':<{w}} {'predicted s':>11} {'measured s':>10} {'error (runs min-max)':>24} "
             f"{'step ms pred':>12} {'step ms meas':>12} {'error':>6} {'(b) link + sync':>22}"]
    for world, name, pred, meas, err, low, high, step, mstep, serr, n, b_err, b_low, b_high in rows:
        spread = f"{100 * err:+.0f}% ({n}: {100 * low:+.0f}..{100 * high:+.0f}%)"
        synced = "-" if b_err is None else f"{100 * b_err:+.0f}% ({100 * b_low:+.0f}..{100 * b_high:+.0f}%)"
        lines.append(f"{world:>5} {name:<{w}} {pred:>11.2f} {meas:>10.2f} {spread:>24} {1e3 * step:>12.1f} "
                     f"{1e3 * mstep:>12.1f} {100 * serr:>+5.0f}% {synced:>22}")
    return "\n".join(lines)


def main_study(args, parser) -> int:
    """`python -m minidp.simulate --study FILE`: the time-to-target table, its plot, or the validation."""
    try:
        study = ttt.load(args.study)
        if args.methods:  # compare only these (and exact, the reference)
            wanted = ["exact"] + [m.strip() for m in args.methods.split(",") if m.strip() and m.strip() != "exact"]
            unknown = [m for m in wanted if m not in study["methods"]]
            if unknown:
                raise ValueError(f"--methods: {unknown} not in the study; it has {list(study['methods'])}")
            study["methods"] = {m: study["methods"][m] for m in wanted}
        if args.validate:
            print(format_validation(validate(study)))
            return 0
        check_number("--compute-scale", args.compute_scale, positive=True)
        gbits = [check_number("--bandwidths", float(g), positive=True) for g in args.bandwidths.split(",")]
        sizes = args.world_sizes if args.world_sizes_given else ttt.STUDY_WORLD_SIZES
        latency = 15.0 if args.inter_latency_us is None else args.inter_latency_us
        table = ttt.relative_table(study, sizes, gbits, latency, args.compute_scale, args.algorithm or "ring")
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"{type(e).__name__}: {e}")
    print(f"{args.study}: target {study.get('target')} ({study.get('metric', 'validation loss')}); compute "
          f"{1e3 * study['compute_s']['1'] * args.compute_scale:.2f} ms a step; every rank on its own node, "
          f"{latency:g} us per message, {args.algorithm or 'ring'} all-reduce; no overlap")
    print(ttt.format_table(study, table))
    if args.plot:
        name = args.study.split("/")[-1]
        ttt.plot_fastest(args.plot, table, f"fastest to the target, speed-up over exact ({name}, "
                     f"compute x{args.compute_scale:g})")
    return 0
