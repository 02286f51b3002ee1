"""The compression study's report: the study JSON the simulator reads, the tables, the sanity checks.

    python benchmarks/compression/study.py --phases report    # reads OUT/compression_runs.jsonl (used by study.py)

study(): per method, at its chosen lr, over the seeds at world size 2: steps to the target, final
validation loss, time to the target and median step (measured), bytes per step, the collectives of
one step, and cost_s: the method's median step at world size 1 over a step with no communication in
the same launch (what compress, decompress and memory cost here; see cost_shares). compute_s: the
no-communication step at world sizes 1, 2 and 4; network: the gloo links fitted at 2 and 4 ranks;
measured: time to target, steps to target and median step of the validation runs at world sizes 2 and
4 (the newest validate invocation: one run per launch), each with the compute measured in its own launch
(before and after the runs) and the link fitted to its launch's in-step all-reduce probes. Others' work
shares the cores in bursts: the world-size-1 costs take the fastest of their repeats in each launch
(what the code costs), the validation pairs each run with its launch's load.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics

import torch

import compression_task as task
from minidp.study import validation

NETWORK_SIZES = tuple(4 ** k * 1024 for k in range(7))  # 1 KiB ... 4 MiB: the study's buffers are up to 1.2 MB


def measure_links(path: str, quick: bool = False, repeats: int = 1) -> dict:
    """Gloo all-reduce sweeps at world sizes 2 and 4 on this machine, `repeats` launches each (alternating
    2 and 4), the median per size over launches fitted to a ring link; written to `path` with every sweep."""
    from minidp.study.network import fit_ring, measure_allreduce

    out, sweeps = {"sweeps": {}}, {2: [], 4: []}
    for _ in range(repeats):
        for world in (2, 4):
            sizes = NETWORK_SIZES[::3] if quick else NETWORK_SIZES
            sweeps[world].append(measure_allreduce(world, sizes, repeats=3 if quick else 15))
    for world, found in sweeps.items():
        sweep = {size: statistics.median(s[size] for s in found) for size in found[0]}
        link = fit_ring(sweep, world)
        out[str(world)] = {"latency_s": link.latency_s, "bandwidth": link.bandwidth}
        out["sweeps"][str(world)] = [{str(k): v for k, v in s.items()} for s in found]
        spread = [fit_ring(s, world).latency_s * 1e6 for s in found]
        print(f"gloo all-reduce at {world} ranks: {link.latency_s * 1e6:.0f} us, {link.bandwidth / 1e9:.2f} GB/s "
              f"(median of {len(found)} sweeps; latency per sweep {min(spread):.0f}-{max(spread):.0f} us)")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def _latest(rows: list) -> dict:
    """Rows by (phase, method, lr, seed, world size), the last one written winning."""
    return {(r["phase"], r["method"], r["lr"], r["seed"], r["world_size"]): r for r in rows}


def _after_first(row: dict):
    """Measured time to the target without the first step (its one-time set-up; the simulator leaves it out too)."""
    return None if row["time_to_target_s"] is None else row["time_to_target_s"] - row["first_step_s"]


def _newest_batch(rows: list, phase: str) -> list:
    """The rows of `phase` written by the newest invocation that ran it (its "batch" tag); untagged rows
    (written before 2026-12-04's tags) count as one batch older than any tagged one."""
    rows = [r for r in rows if r["phase"] == phase]
    newest = max((r.get("batch", "") for r in rows), default="")
    return [r for r in rows if r.get("batch", "") == newest]


def _launches(rows: list, world: int, sweep_link: dict | None = None) -> list:
    """The newest validate batch's launches at `world` ranks, in order: each opens and closes with a
    no-communication run (and, from 2026-12-04 on, the in-step all-reduce probes beside them).

    Returns [{"compute_s": the mean of its no-communication medians, "rows": {method: row},
    "link": the ring link fitted to its probes (each probe's median step less compute_s), or None,
    "sync_s": with `sweep_link` (the network phase's link at `world`), what a probe's step costs beyond
    its compute and its all-reduce on that link (the median over sizes, at least 0), or None}].
    """
    from minidp.study.network import Link, Network, allreduce_time, fit_ring

    out, noops = [], 0
    for r in _newest_batch(rows, "validate"):
        if r["world_size"] != world:
            continue
        if r["method"] == "noop":
            if noops % 2 == 0:
                out.append({"noop": [], "rows": {}, "probes": {}})
            out[-1]["noop"].append(r["median_step_s"])
            noops += 1
        elif r["method"] == "probe" and out:
            out[-1]["probes"].setdefault(r["probe_bytes"], []).append(r["median_step_s"])
        elif out:
            out[-1]["rows"][r["method"]] = r
    for launch in out:
        launch["compute_s"] = sum(launch["noop"]) / len(launch["noop"])
        sweep = {b: statistics.median(t) - launch["compute_s"] for b, t in launch.pop("probes").items()}
        link = fit_ring(sweep, world) if len(sweep) >= 2 else None
        launch["link"] = link and {"latency_s": link.latency_s, "bandwidth": link.bandwidth}
        launch["sync_s"] = None
        if sweep and sweep_link:
            net = Network(Link(**sweep_link), Link(**sweep_link), ranks_per_node=world)
            launch["sync_s"] = max(0.0, statistics.median(t - allreduce_time(b, world, net) for b, t in sweep.items()))
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def bytes_to_target(row: dict, steps, start: int):
    """Bytes this rank handed to collectives until the target: `start` steps of every gradient (the warm-up:
    DDP's all-reduce, 1-bit Adam's all-gather), then the method's measured bytes per step; None if never."""
    if steps is None:
        return None
    return min(steps, start) * row["param_bytes"] + max(0, steps - start) * row["bytes_measured"]


def cost_shares(rows: list, per_rank: int) -> tuple:
    """(compute_1, {method: cost share}) from the cost phase's launches.

    A launch: consecutive cost rows of one (batch, repeat) tag (untagged rows: up to a row of another
    phase). Per method, the launches of the newest batch that measured it (a batch: one invocation).
    A run's step: its mean after the warm-up where recorded (from 2026-12-04: a method that works every
    k steps costs that work once in k, which a median leaves out), else its median.
    compute_1: the fastest no-communication step of the newest batch's launches (the least disturbed:
    what the compute costs). A method's share, per launch: its fastest step over that launch's fastest
    no-communication step, minus 1; the median over launches. Each method is paired with the compute of
    its own launch because the machine's speed moved between launches and days (others' load: the
    no-communication step measured 4.6 ms on 2026-12-03 and 1.9 ms on 2026-12-04), and the model scales
    a cost with the compute anyway (time_to_target.step_time).
    """
    launches, key = [], None
    for r in rows:
        tag = (r.get("batch", ""), r.get("repeat"))
        if r["phase"] != "cost" or r.get("per_rank_batch") != per_rank:
            key = None
            continue
        if tag != key:
            key = tag
            launches.append({"batch": tag[0], "steps": {}})
        launches[-1]["steps"].setdefault(r["method"], []).append(r.get("mean_step_s", r["median_step_s"]))
    launches = [launch for launch in launches if "noop" in launch["steps"]]
    if not launches:
        return None, {}
    newest = {}  # method: the newest batch that measured it
    for launch in launches:
        for m in launch["steps"]:
            newest[m] = max(newest.get(m, ""), launch["batch"])
    shares = {}
    for launch in launches:
        base = min(launch["steps"]["noop"])
        for m, steps in launch["steps"].items():
            if launch["batch"] == newest[m]:
                shares.setdefault(m, []).append(min(steps) / base - 1)
    compute_1 = min(min(launch["steps"]["noop"]) for launch in launches if launch["batch"] == newest["noop"])
    return compute_1, {m: statistics.median(v) for m, v in shares.items()}


def _cost(method: str, shares: dict, compute_1, onebit_compression_s: float | None = None) -> float:
    """What the method adds to a step at compute_1 (its share of the compute; 0 if not measured).

    1-bit Adam at world size 1 compresses nothing (DeepSpeed's rule): its compression is added, measured
    by itself where the payload phase did (`onebit_compression_s`: comm.Sign's stages over its momentum,
    in seconds at that phase's compute), else by proxy: the hook "Sign+EF"'s share (comm.Sign with error
    feedback over every gradient, with a hook's bucket copies besides).
    """
    if method not in shares or not compute_1:
        return 0.0
    if task.METHODS[method] != "onebit":
        return shares[method] * compute_1
    if onebit_compression_s is not None:
        return shares[method] * compute_1 + onebit_compression_s
    return (shares[method] + shares.get("Sign+EF", 0.0)) * compute_1


def study(args, rows: list, lrs: dict) -> dict:
    """The study file (see the module docstring) from RUNS' rows and the chosen lrs."""
    latest, per_rank = _latest(rows), args.global_batch // 2
    compute_1, shares = cost_shares(rows, per_rank)
    compute = {"1": compute_1}
    for batch in (per_rank // 2,):  # world size 4's per-rank batch, at world size 1: what the validation
        # scales a cost at 4 ranks by (the cost phase with --global-batch halved measures it)
        if cost_shares(rows, batch)[0]:
            compute[f"1@{batch}"] = cost_shares(rows, batch)[0]
    payload_path = os.path.join(args.out, "compression_payload.json")  # the payload phase's
    measured = json.load(open(payload_path)) if os.path.exists(payload_path) else {}
    payloads = measured.get("per_payload_s", {})
    net_path = os.path.join(args.out, "compression_network.json")
    network = {}
    if os.path.exists(net_path):
        with open(net_path) as f:
            network = {k: v for k, v in json.load(f).items() if k != "sweeps"}
    launches = {w: _launches(rows, w, network.get(str(w))) for w in (2, 4)}
    for w, found in launches.items():
        if found:
            compute[str(w)] = min(launch["compute_s"] for launch in found)
    methods = {}
    for m in args.methods:
        if m not in lrs:
            continue
        runs = [latest[k] for k in sorted(latest) if k[0] in ("sweep", "seeds") and k[1] == m and k[2] == lrs[m]
                and k[4] == 2 and k[3] < args.seeds]
        first = runs[0]
        start = first.get("method_start", args.start_iter)  # rows before 2026-12-04 lack it: start_iter
        # the collectives of one step: from the newest run at world size 2
        newest = ([r for r in rows if r["method"] == m and r["world_size"] == 2 and r["phase"] != "cost"]
                  or [first])[-1]
        # 2026-12-04's validation rows also list minidp.DDP's status all-reduce ("engine"): gone since 3bb5da5
        own = [c for c in newest["collectives"] if not c.get("engine")]
        methods[m] = {
            "lr": lrs[m], "seeds": [r["seed"] for r in runs], "steps_to_target": [r["steps_to_target"] for r in runs],
            "final_val_loss": [r["final_val_loss"] for r in runs],
            "bytes_measured": first["bytes_measured"], "bytes_analytical": first["bytes_analytical"],
            "param_bytes": first["param_bytes"], "collectives": own, "start_iter": start,
            "bytes_to_target": [bytes_to_target(first, r["steps_to_target"], start) for r in runs],
            "cost_s": _cost(m, shares, compute_1, measured.get("onebit_compression_s")),
            "payload_cost_s": payloads.get(m, 0.0),
            "measured": {},
            "sweep": {str(r["lr"]): [r["steps_to_target"], r["final_val_loss"]] for k, r in latest.items()
                      if k[0] == "sweep" and k[1] == m},
        }
        if "warmup_collectives" in newest:
            methods[m]["warmup_collectives"] = newest["warmup_collectives"]
        for w, found in launches.items():  # the validation runs (seed 0, until the target), one per launch,
            # each with the compute measured in its launch (so with that launch's share of others' load)
            runs = [{"time_to_target_s": _after_first(launch["rows"][m]), "step_s": launch["rows"][m]["median_step_s"],
                     "compute_s": launch["compute_s"], "steps_to_target": launch["rows"][m]["steps_to_target"],
                     **({"link": launch["link"]} if launch["link"] else {}),
                     **({"sync_s": launch["sync_s"]} if launch["sync_s"] is not None else {})}
                    for launch in found if m in launch["rows"]]
            if runs:
                methods[m]["measured"][str(w)] = {"runs": runs}
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, CPU only, gloo",
            "task": f"CharMLP ({task.__name__}.py) on {task.Text.__doc__.split(':')[0].lower()}",
            "metric": "validation loss, nats per character", "target": args.target, "world_size": 2,
            "global_batch": args.global_batch, "steps": args.steps, "eval_every": args.eval_every,
            "start_iter": args.start_iter, "lrs_swept": args.lrs, "adam_lrs_swept": args.adam_lrs,
            "freeze_step": args.freeze_step, "compute_s": compute, "network": network,
            "methods": methods}


def _spread(values, fmt="{:.0f}") -> str:
    vals = [math.inf if v is None or v != v else v for v in values]
    med, low, high = statistics.median(vals), min(vals), max(vals)
    show = lambda v: "never" if math.isinf(v) else fmt.format(v)  # noqa: E731
    return f"{show(med)} ({show(low)}-{show(high)})"


def _collectives(m: dict) -> str:
    """The method's collectives per step, by kind."""
    counts = {}
    for c in m["collectives"]:
        key = c["op"].replace("_", "-")
        counts[key] = counts.get(key, 0) + c["per_step"]
    return ", ".join(f"{n:g} {op}" for op, n in counts.items())


def tables(s: dict) -> str:
    """Markdown: the main table, the lr sweep, the sanity checks."""
    exact = s["methods"]["exact"]
    lines = [f"Target: {s['metric']} <= {s['target']}; {len(exact['seeds'])} seeds; median (min-max).", "",
             "| method | lr | steps to target | final val loss | bytes/step measured | formula | vs exact | "
             "MB to target | collectives/step | cost ms/step |", "|" + " --- |" * 10]
    for name, m in s["methods"].items():
        lines.append(f"| {name} | {m['lr']:g} | {_spread(m['steps_to_target'])} | "
                     f"{_spread(m['final_val_loss'], '{:.3f}')} | {m['bytes_measured']:,.0f} | "
                     f"{m['bytes_analytical']:,.0f} | {m['bytes_measured'] / m['param_bytes']:.4f} | "
                     f"{_spread([b and b / 1e6 for b in m['bytes_to_target']], '{:.1f}')} | "
                     f"{_collectives(m)} | {1e3 * m['cost_s']:.2f} |")
    lrs = sorted({lr for m in s["methods"].values() for lr in m["sweep"]}, key=float)  # every lr any method ran
    lines += ["", "LR sweep (seed 0): steps to target (final val loss); **bold**: chosen; -: not run", "",
              "| method | " + " | ".join(lrs) + " |", "|" + " --- |" * (len(lrs) + 1)]
    for name, m in s["methods"].items():
        cells = []
        for lr in lrs:
            steps, final = m["sweep"].get(lr, (None, None))
            text = "-" if final is None else f"{steps or 'never'} ({final:.3f})"
            cells.append(f"**{text}**" if float(lr) == m["lr"] else text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| sanity check (literature) | verdict | measured |", "| --- | --- | --- |"]
    lines += [f"| {check} | {verdict} | {detail} |" for check, verdict, detail in sanity(s)]
    return "\n".join(lines)


def _med(values) -> float:
    return statistics.median(math.inf if v is None or v != v else v for v in values)


def sanity(s: dict) -> list:
    """(check, verdict, measured) for the literature's three claims.

    "At least as good": median steps to target no more, median final loss no higher than the plain
    method's plus the larger half-range of the two seeds' spreads (noise). "Close to exact": median
    steps within 1.25x exact's and median final loss within 0.05 nats of exact's.
    """
    ms, out = s["methods"], []

    def brief(name):
        return f"{name}: {_spread(ms[name]['steps_to_target'])} steps, {_spread(ms[name]['final_val_loss'], '{:.3f}')}"
    if "Sign" in ms and "Sign+EF" in ms:
        a, b = ms["Sign+EF"], ms["Sign"]
        noise = max((max(x["final_val_loss"]) - min(x["final_val_loss"])) / 2 for x in (a, b))
        ok = _med(a["steps_to_target"]) <= _med(b["steps_to_target"]) and \
            _med(a["final_val_loss"]) <= _med(b["final_val_loss"]) + noise
        out.append(("EF-Sign at least as good as Sign", "reproduced" if ok else "NOT reproduced",
                    f"{brief('Sign+EF')}; {brief('Sign')}"))
    for name in ("TopK 1%+EF", "PowerSGD 4+EF"):
        if name in ms:
            m, e = ms[name], ms["exact"]
            if math.isinf(_med(e["steps_to_target"])):
                out.append((f"{name} close to exact", "no verdict", "exact never reached the target"))
                continue
            ok = _med(m["steps_to_target"]) <= 1.25 * _med(e["steps_to_target"]) and \
                _med(m["final_val_loss"]) <= _med(e["final_val_loss"]) + 0.05
            out.append((f"{name} close to exact", "reproduced" if ok else "NOT reproduced",
                        f"{brief(name)}; {brief('exact')}"))
    return out + headlines(s)


# The papers' headlines: (method, baseline, factor of fewer bytes, the claim in words)
HEADLINES = (("DeMo", "Adam", 85, "DeMo: ~85x less data than AdamW with DDP"),
             ("Streaming DiLoCo /8", "exact", 100, "Streaming DiLoCo: ~100x less bandwidth, same loss"),
             ("1-bit Adam", "Adam", 5, "1-bit Adam: 5x less communication than Adam, same convergence"))


def headlines(s: dict) -> list:
    """(claim, verdict, measured) per paper headline whose method and baseline are in the study.

    Measured: the baseline's median bytes to the target over the method's (the same loss reached, so
    "less data for the same loss"); reproduced when it reaches 0.8 x the paper's factor and the method
    reaches the target in no more than 1.25 x the baseline's median steps. Bytes are what a rank hands
    to collectives, at world size 2 (where an all-gather's input equals what a ring sends).
    """
    ms, out = s["methods"], []
    for name, base, factor, claim in HEADLINES:
        if name not in ms or base not in ms:
            continue
        m, b = ms[name], ms[base]
        mine, theirs = _med(m["bytes_to_target"]), _med(b["bytes_to_target"])
        if math.isinf(theirs):
            out.append((claim, "no verdict", f"{base} never reached the target"))
            continue
        ratio = theirs / mine
        steps = _med(m["steps_to_target"]) / _med(b["steps_to_target"])
        ok = ratio >= 0.8 * factor and steps <= 1.25
        out.append((claim, "reproduced" if ok else "NOT reproduced",
                    f"{ratio:.1f}x fewer bytes to target than {base} ({b['bytes_measured'] / m['bytes_measured']:.1f}x "
                    f"per step), {steps:.2f}x its steps"))
    return out


def report(args, rows: list, lrs: dict) -> dict:
    """Write OUT/compression_study.json, print the tables (and into --results-md between markers)."""
    s = study(args, rows, lrs)
    path = os.path.join(args.out, "compression_study.json")
    with open(path, "w") as f:
        json.dump(s, f, indent=1)
    text = tables(s)
    if s["network"] and all(w in s["compute_s"] for w in s["network"]):
        text += "\n\nPredicted (python -m minidp.simulate --study ... --validate) against measured time to target:\n\n"
        text += "```\n" + validation.format_validation(validation.validate(s)) + "\n```"
    print(text)
    print(f"wrote {path}")
    if args.results_md:
        from results_md import write_section

        write_section(args.results_md, "compression cpu", text)
    return s
