"""`python -m minidp.simulate goodput`: goodput.py's two ways at each GPU count, its inputs and where they come from.

    python -m minidp.simulate goodput --gpus 1024,16384 --restart-s 300 --checkpoint-every-s 1800
    python -m minidp.simulate goodput --measured benchmarks/results/ft_goodput.json --json goodput.json

A cost comes from its flag when given, else from --measured's JSON (keys: the Costs fields, detect_s,
restart_s, heal_s, peer_wait_s, quorum_s, step_s, checkpoint_write_s; a key it lacks, or null, falls
back), else from its default (goodput.SOURCES says where each default comes from). Every input is
checked before any work: a bad one is one line that names its flag and value, and exit status 2.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

from ..validate import check_int, check_number
from .goodput import (
    GPUS,
    GPUS_PER_REPLICA,
    LLAMA3_FAILURES_PER_GPU_HOUR,
    RATE_SOURCE,
    SOURCES,
    Costs,
    check_cost,
    checkpoint_interval_s,
    failure_cost_heal_s,
    failure_cost_restart_s,
    goodput_heal,
    goodput_restart,
    job_mtbf_s,
    monte_carlo,
    replica_groups,
)

FLAGS = {name: "--" + name.replace("_", "-") for name in SOURCES}  # step_s -> --step-s
MODEL = ("model (first order, per failure of the job): (a) restart: goodput = (1 - C/P) (1 - (D + R + P/2) / MTBF)\n"
         "                                             (b) heal:    goodput = S/(S + q) (1 - (D + S + W + (R + H) / "
         "replicas) / MTBF)")


def goodput_rows(gpus=GPUS, failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR, costs: Costs | None = None,
                 gpus_per_replica: int = GPUS_PER_REPLICA, checkpoint_every_s: float | None = None, runs: int = 20,
                 failures_per_run: int = 1000, seed: int = 0) -> list:
    """One dict a GPU count: failures an hour, MTBF, (a)'s interval, both goodputs analytic and Monte-Carlo
    (with standard error and tolerance: 3 standard errors + (cost of a failure / MTBF)^2), heal / restart.

    Args: as goodput.monte_carlo's, with `gpus` a list of GPU counts; costs None: Costs()'s defaults.
    """
    costs = Costs() if costs is None else costs
    rows = []
    for n in gpus:
        replicas = replica_groups(n, gpus_per_replica)
        mtbf_s = job_mtbf_s(n, failures_per_gpu_hour)
        interval = checkpoint_interval_s(costs, mtbf_s, checkpoint_every_s)
        mc = monte_carlo(n, failures_per_gpu_hour, costs, gpus_per_replica, interval, runs, failures_per_run, seed)
        row = {"gpus": n, "replicas": replicas, "failures_per_hour": 3600 / mtbf_s, "mtbf_h": mtbf_s / 3600,
               "checkpoint_every_s": interval, "restart": goodput_restart(costs, mtbf_s, interval),
               "heal": goodput_heal(costs, mtbf_s, replicas)}
        costs_s = {"restart": failure_cost_restart_s(costs, interval), "heal": failure_cost_heal_s(costs, replicas)}
        for way in ("restart", "heal"):
            mean, error = mc[way]
            row.update({f"{way}_mc": mean, f"{way}_mc_se": error,
                        f"{way}_tolerance": 3 * error + (costs_s[way] / mtbf_s) ** 2})
        row["heal_over_restart"] = row["heal"] / row["restart"] if row["restart"] else None
        rows.append(row)
    return rows


def format_table(rows: list) -> str:
    """The terminal table of goodput_rows()'s rows: analytic goodput, then the Monte-Carlo's."""
    lines = [f"{'GPUs':>6} {'replicas':>8} {'failures/h':>10} {'MTBF h':>7} {'ckpt every s':>12} "
             f"{'restart %':>9} {'(MC)':>6} {'heal %':>7} {'(MC)':>6} {'heal/restart':>12}"]
    for r in rows:
        ratio = "-" if r["heal_over_restart"] is None else f"{r['heal_over_restart']:.3f}"
        lines.append(f"{r['gpus']:>6,} {r['replicas']:>8,} {r['failures_per_hour']:>10.3f} {r['mtbf_h']:>7.2f} "
                     f"{r['checkpoint_every_s']:>12,.0f} {100 * r['restart']:>9.2f} {100 * r['restart_mc']:>6.2f} "
                     f"{100 * r['heal']:>7.2f} {100 * r['heal_mc']:>6.2f} {ratio:>12}")
    return "\n".join(lines)


def format_check(rows: list) -> str:
    """Monte-Carlo minus analytic per row and way, in points, against the tolerance; and where they differ."""
    lines = [f"{'GPUs':>6} {'restart: MC - analytic':>26} {'heal: MC - analytic':>26}"]
    differ = []
    for r in rows:
        cells = []
        for way in ("restart", "heal"):
            gap = r[f"{way}_mc"] - r[way]
            cells.append(f"{100 * gap:+.3f} (tol {100 * r[f'{way}_tolerance']:.3f})")
            if abs(gap) > 3 * r[f"{way}_mc_se"]:
                verdict = "within" if abs(gap) <= r[f"{way}_tolerance"] else "BEYOND"
                differ.append(f"{way} at {r['gpus']:,} GPUs ({100 * gap:+.3f} points, {verdict} tolerance)")
        lines.append(f"{r['gpus']:>6,} {cells[0]:>26} {cells[1]:>26}")
    if not differ:
        lines.append("they agree: every gap is within 3 standard errors of the Monte-Carlo")
        return "\n".join(lines)
    lines.append("they differ by more than 3 standard errors of the Monte-Carlo: " + "; ".join(differ) + ".")
    lines.append("Within tolerance: the first-order formulas charge every failure its whole cost, though one during "
                 "a restart,\na checkpoint write or a group's absence costs less (the (cost / MTBF)^2 term they drop; "
                 "the Monte-Carlo is\nthe better figure there). BEYOND: a fault in the formulas or the simulation.")
    return "\n".join(lines)


def load_measured(path: str) -> tuple:
    """({cost: seconds}, [ignored keys]) from --measured's JSON object; a cost it lacks, or null, is left out."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--measured={path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--measured={path!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--measured={path!r} holds a {type(data).__name__}: it must hold an object of seconds, "
                         f"keys {', '.join(SOURCES)}")
    measured = {key: check_cost(f"--measured {path}: {key}", data[key])
                for key in SOURCES if data.get(key) is not None}
    return measured, sorted(set(data) - set(SOURCES))


def resolve(args) -> dict:
    """Every input of the command, checked, with where it came from; ValueError/TypeError name the flag."""
    measured, ignored = load_measured(args.measured) if args.measured else ({}, [])
    values, sources = {}, {}
    for name, flag in FLAGS.items():
        given = getattr(args, name)
        if given is not None:
            values[name], sources[flag] = check_cost(flag, given), "given"
        elif name in measured:
            values[name], sources[flag] = measured[name], f"measured: {args.measured}"
        else:
            values[name], sources[flag] = getattr(Costs(), name), f"default, {SOURCES[name]}"
    rate = _given_or(args.failures_per_gpu_hour, LLAMA3_FAILURES_PER_GPU_HOUR, "--failures-per-gpu-hour",
                     RATE_SOURCE, sources)
    if not (check_number("--failures-per-gpu-hour", rate, positive=True) and math.isfinite(rate)):
        raise ValueError(f"--failures-per-gpu-hour={rate!r} must be finite")
    per_replica = check_int("--gpus-per-replica", _given_or(args.gpus_per_replica, GPUS_PER_REPLICA,
                                                            "--gpus-per-replica", "a node of 8 GPUs", sources), 1)
    gpus = _gpus(_given_or(args.gpus, ",".join(map(str, GPUS)), "--gpus", "1,024 ... 16,384, doubling", sources),
                 per_replica)
    every = _checkpoint_every(args.checkpoint_every_s, values["checkpoint_write_s"])
    check_int("--mc-runs", args.mc_runs, 2)
    check_int("--mc-failures", args.mc_failures, 1)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise ValueError(f"--json={args.json!r}: no folder {os.path.dirname(os.path.abspath(args.json))!r}")
    return {"gpus": gpus, "failures_per_gpu_hour": rate, "gpus_per_replica": per_replica, "costs": Costs(**values),
            "checkpoint_every_s": every, "sources": sources, "ignored": ignored}


def _given_or(given, default, flag: str, source: str, sources: dict):
    sources[flag] = "given" if given is not None else f"default, {source}"
    return default if given is None else given


def _gpus(text: str, per_replica: int) -> list:
    try:
        gpus = [int(n) for n in text.split(",")]
    except ValueError:
        raise ValueError(f"--gpus={text!r} must be GPU counts separated by commas, e.g. 1024,16384") from None
    for n in gpus:
        check_int("--gpus", n, 1)
        if n % per_replica:
            raise ValueError(f"--gpus={n} is not a multiple of --gpus-per-replica={per_replica}")
        if n // per_replica < 2:
            raise ValueError(f"--gpus={n} makes 1 replica of --gpus-per-replica={per_replica}: healing needs a "
                             "live peer, at least 2 replicas")
    return gpus


def _checkpoint_every(every, write_s: float):
    if every is None:
        if write_s == 0:
            raise ValueError("--checkpoint-write-s=0 makes Young/Daly's interval 0: give --checkpoint-every-s")
        return None
    if not check_cost("--checkpoint-every-s", every) > write_s:
        raise ValueError(f"--checkpoint-every-s={every!r} must be > --checkpoint-write-s={write_s!r}")
    return every


def format_assumptions(inputs: dict, runs: int, failures: int, seed: int) -> str:
    """The inputs, one a line: value, and where it comes from (given, measured, or the default's source)."""
    costs, sources = inputs["costs"], inputs["sources"]
    shown = {"--gpus": ",".join(map(str, inputs["gpus"])), "--failures-per-gpu-hour":
             f"{inputs['failures_per_gpu_hour']:.4g}", "--gpus-per-replica": str(inputs["gpus_per_replica"]),
             **{flag: f"{getattr(costs, name):g}" for name, flag in FLAGS.items()}}
    every = inputs["checkpoint_every_s"]
    shown["--checkpoint-every-s"] = "Young/Daly" if every is None else f"{every:g}"
    sources["--checkpoint-every-s"] = "given" if every is not None else (
        f"sqrt(2 x {costs.checkpoint_write_s:g} s x the job's MTBF), per row: 'ckpt every s'")
    width = max(len(value) for flag, value in shown.items() if flag != "--gpus")  # a long list runs over
    lines = ["assumptions (value: where it comes from)"]
    lines += [f"  {flag:<24} {value:<{width}}  {sources[flag]}" for flag, value in shown.items()]
    lines.append(f"  {'Monte-Carlo':<24} {runs} runs a row, ~{failures:,} failures each (--mc-runs, --mc-failures), "
                 f"--seed {seed}")
    if inputs["ignored"]:
        lines.append(f"  --measured's keys not used: {', '.join(inputs['ignored'])}")
    return "\n".join(lines)


def parse_args(argv=None):
    """(parser, args, resolve()'s inputs); a bad input exits with status 2 and one line naming it."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m minidp.simulate goodput", usage="%(prog)s [options] (--help: the list)",
                                description="Goodput under failures at scale: restart from a checkpoint, or heal "
                                "from a live peer (minidp/study/goodput.py says how each is modelled).")
    p.add_argument("--gpus", help="GPU counts, one row each (default " + ",".join(map(str, GPUS)) + ")")
    p.add_argument("--failures-per-gpu-hour", type=float,
                   help=f"default {LLAMA3_FAILURES_PER_GPU_HOUR:.4g}: {RATE_SOURCE}")
    p.add_argument("--gpus-per-replica", type=int, help="GPUs a failure takes out in (b) (default 8: a node)")
    for name, flag in FLAGS.items():
        p.add_argument(flag, type=float, help=f"default {getattr(Costs(), name):g}: {SOURCES[name]}")
    p.add_argument("--checkpoint-every-s", type=float, help="(a)'s interval (default: Young/Daly's, per row)")
    p.add_argument("--measured", metavar="JSON", help="measured costs, keys " + ", ".join(SOURCES))
    p.add_argument("--json", metavar="PATH", help="also write the assumptions and the rows here")
    p.add_argument("--mc-runs", type=int, default=20, help="Monte-Carlo runs a row (default 20)")
    p.add_argument("--mc-failures", type=int, default=1000, help="expected failures a run (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the Monte-Carlo's seed (default 0)")
    args = p.parse_args(argv)
    try:
        inputs = resolve(args)
    except (ValueError, TypeError) as e:
        p.exit(2, f"{p.prog}: error: {e}\n")  # one line: argparse's usage would bury it
    return p, args, inputs


def main(argv=None) -> int:
    p, args, inputs = parse_args(argv)
    rows = goodput_rows(inputs["gpus"], inputs["failures_per_gpu_hour"], inputs["costs"], inputs["gpus_per_replica"],
                        inputs["checkpoint_every_s"], args.mc_runs, args.mc_failures, args.seed)
    print("goodput under failures: (a) restart from a checkpoint, (b) heal from a live peer; "
          "analytic, then (MC) Monte-Carlo")
    print(format_assumptions(inputs, args.mc_runs, args.mc_failures, args.seed), end="\n\n")
    print(MODEL, end="\n\n")
    print(format_table(rows), end="\n\n")
    print("Monte-Carlo check, in points (tolerance: 3 standard errors + (cost of a failure / MTBF)^2):")
    print(format_check(rows))
    if args.json:
        shown = {**inputs, "costs": asdict(inputs["costs"]), "mc_runs": args.mc_runs,
                 "mc_failures": args.mc_failures, "seed": args.seed}
        try:
            with open(args.json, "w") as f:
                json.dump({"assumptions": shown, "rows": rows}, f, indent=1)
        except OSError as e:
            p.exit(2, f"{p.prog}: error: --json={args.json!r}: {e.strerror}\n")
        print(f"wrote {args.json}")
    return 0
