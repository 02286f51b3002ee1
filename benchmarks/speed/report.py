"""Turn raw benchmark results into numbers people read: ratios, limits, markdown tables, a plot.

Definitions (also written into RESULTS.md):
  * step time: median of the timed steps; spread: p25-p75 (IQR);
  * ratio: median(minidp) / median(DDP), < 1 means minidp is faster; its spread: the p25-p75 of
    the per-round ratios (each round's minidp median over the same round's DDP median), which
    shows how much the machine's noise moves the ratio;
  * samples/s: batch_per_rank * world_size / median step time;
  * T_compute: the same step under the engine's no_sync() (forward, backward, optimizer; no
    communication); T_allreduce: all-reducing the gradient bytes alone, cut into the same buckets;
  * hidden share = (T_compute + T_allreduce - T_step) / T_allreduce, clamped to [0, 1]: 1 means
    the step costs no more than compute (all communication overlapped), 0 means none of it was.
"""
from __future__ import annotations

import os
import re

import numpy as np

ENGINE_LABEL = {"minidp": "minidp", "ddp": "DDP"}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def with_iqr(stats: dict) -> str:
    return f"{ms(stats['median'])} [{ms(stats['p25'])}-{ms(stats['p75'])}]"


def cap_label(cap) -> str:
    return "default (1 MiB first, 25)" if cap is None else f"{cap:g}"


def ratio(result: dict) -> float:
    """median(minidp) / median(DDP) for the synced step."""
    return result["phases"]["minidp"]["median"] / result["phases"]["ddp"]["median"]


def round_ratios(result: dict) -> dict:
    """Quartiles of the per-round ratios minidp/DDP (the phases alternate round by round)."""
    k = result["job"]["steps"]
    a, b = result["phases"]["minidp"]["values"], result["phases"]["ddp"]["values"]
    per_round = [np.median(a[i:i + k]) / np.median(b[i:i + k]) for i in range(0, min(len(a), len(b)), k)]
    p25, p50, p75 = np.percentile(per_round, [25, 50, 75])
    return {"p25": float(p25), "median": float(p50), "p75": float(p75), "rounds": len(per_round)}


def samples_per_s(result: dict, engine: str) -> float:
    return result["batch_per_rank"] * result["world_size"] / result["phases"][engine]["median"]


def limits(result: dict, engine: str) -> dict | None:
    """The step against compute + all-reduce and max(compute, all-reduce); None without them."""
    phases = result["phases"]
    if "allreduce" not in phases:
        return None
    step, compute = phases[engine]["median"], phases[f"{engine}_nosync"]["median"]
    comm = phases["allreduce"]["median"]
    hidden = (compute + comm - step) / comm if comm > 0 else 0.0
    return {"step": step, "compute": compute, "allreduce": comm, "serial": compute + comm,
            "overlapped": max(compute, comm), "hidden": min(1.0, max(0.0, hidden))}


def derive(result: dict) -> dict:
    """The figures the tables show, added to a result (kept in the JSON for later reading)."""
    out = {"ratio": ratio(result), "ratio_rounds": round_ratios(result),
           "samples_per_s": {e: samples_per_s(result, e) for e in ENGINE_LABEL},
           "construction_ratio": (result["construction"]["minidp"]["median"]
                                  / result["construction"]["ddp"]["median"])}
    out["limits"] = {e: limits(result, e) for e in ENGINE_LABEL} if "allreduce" in result["phases"] else None
    return out


def ratio_cell(result: dict) -> str:
    spread = result["derived"]["ratio_rounds"]
    return f"**{result['derived']['ratio']:.3f}** [{spread['p25']:.2f}-{spread['p75']:.2f}]"


def is_default(result: dict) -> bool:
    job = result["job"]
    return job["bucket_cap_mb"] is None and not job["gbv"]


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def headline_table(timing: list[dict]) -> str:
    """Default settings: step time, ratio, throughput and construction, per workload and world size."""
    rows = []
    for r in (r for r in timing if is_default(r)):
        d, c = r["derived"], r["construction"]
        rows.append([r["job"]["workload"], r["world_size"], f"{r['params'] / 1e6:.2f}M",
                     with_iqr(r["phases"]["minidp"]), with_iqr(r["phases"]["ddp"]), ratio_cell(r),
                     f"{d['samples_per_s']['minidp']:.0f} / {d['samples_per_s']['ddp']:.0f}",
                     f"{ms(c['minidp']['median'])} / {ms(c['ddp']['median'])}", f"{d['construction_ratio']:.2f}"])
    return table(["workload", "world", "params", "minidp step ms [IQR]", "DDP step ms [IQR]",
                  "minidp/DDP [IQR of per-round ratios]",
                  "samples/s minidp / DDP", "construct ms minidp / DDP", "construct ratio"], rows)


def limits_table(timing: list[dict]) -> str:
    rows = []
    for r in (r for r in timing if r["derived"]["limits"]):
        for engine, label in ENGINE_LABEL.items():
            lim = r["derived"]["limits"][engine]
            rows.append([r["job"]["workload"], r["world_size"], label, ms(lim["step"]), ms(lim["compute"]),
                         ms(lim["allreduce"]), ms(lim["serial"]), ms(lim["overlapped"]), f"{lim['hidden']:.0%}"])
    return table(["workload", "world", "engine", "step ms", "T_compute ms", "T_allreduce ms",
                  "T_c + T_ar", "max(T_c, T_ar)", "comm hidden"], rows)


def variants_table(timing: list[dict]) -> str:
    """gradient_as_bucket_view and the bucket_cap_mb sweep."""
    rows = []
    for r in (r for r in timing if not is_default(r)):
        job = r["job"]
        rows.append([job["workload"], r["world_size"], cap_label(job["bucket_cap_mb"]), job["gbv"],
                     len(r["bucket_numels"]), with_iqr(r["phases"]["minidp"]), with_iqr(r["phases"]["ddp"]),
                     ratio_cell(r)])
    return table(["workload", "world", "bucket_cap_mb", "gradient_as_bucket_view", "buckets",
                  "minidp ms [IQR]", "DDP ms [IQR]", "minidp/DDP [per-round IQR]"], rows)


def memory_medians(memory: list[dict]) -> dict:
    """{(workload, world, gbv): {engine: {baseline/peak/extra medians, runs}}} over the repeats."""
    runs: dict = {}
    for m in memory:
        job = m["job"]
        runs.setdefault((job["workload"], m["world_size"], job["gbv"]), {}).setdefault(job["engine"], []).append(m)
    out: dict = {}
    for key, by_engine in runs.items():
        out[key] = {engine: {field: float(np.median([m[field] for m in ms]))
                             for field in ("baseline_mib", "peak_mib", "extra_mib")} | {"runs": len(ms)}
                    for engine, ms in by_engine.items()}
    return out


def memory_table(memory: list[dict]) -> str:
    """Baseline, extra and peak memory per engine (medians over repeats), paired by (workload, world, gbv)."""
    rows = []
    for (workload, world, gbv), by_engine in memory_medians(memory).items():
        if set(by_engine) != set(ENGINE_LABEL):
            continue
        a, b = by_engine["minidp"], by_engine["ddp"]
        rows.append([workload, world, gbv, a["runs"], f"{a['baseline_mib']:.0f} / {b['baseline_mib']:.0f}",
                     f"{a['extra_mib']:.1f}", f"{b['extra_mib']:.1f}",
                     f"{a['peak_mib']:.0f}", f"{b['peak_mib']:.0f}", f"{a['peak_mib'] / b['peak_mib']:.3f}"])
    return table(["workload", "world", "gradient_as_bucket_view", "runs", "baseline MiB minidp / DDP",
                  "minidp extra MiB", "DDP extra MiB", "minidp peak MiB", "DDP peak MiB", "peak ratio"], rows)


def autotune_table(autotune: list[dict]) -> str:
    """bucket_cap_mb="auto": the cap chosen, its step against each fixed cap's (same rounds), and torch DDP's."""
    rows = []
    for r in autotune:
        phases = r["phases"]
        caps = {name.split("=", 1)[1]: st["median"] for name, st in phases.items() if name.startswith("cap=")}
        best = min(caps, key=caps.get)
        auto = phases["minidp"]["median"]
        rows.append([r["job"]["workload"], r["world_size"], f"{r['chosen']:g}", r["tuning_steps"],
                     ", ".join(f"{c}: {m:.1f}" for c, m in r["tuner_ms"].items()) or "(one layout)",
                     with_iqr(phases["minidp"]), ", ".join(f"{c}: {ms(m)}" for c, m in caps.items()),
                     best, f"**{auto / caps[best]:.3f}**", f"{caps[format(r['chosen'], 'g')] / caps[best]:.3f}",
                     f"{auto / phases['ddp']['median']:.3f}"])
    return table(["workload", "world", "chosen cap (MiB)", "tuning steps", "tuner's medians ms (rank 0)",
                  "auto step ms [IQR]", "fixed caps, step ms", "best cap", "auto / best",
                  "chosen cap's own phase / best", "auto / DDP(chosen)"], rows)


def section(meta: dict, timing: list[dict], memory: list[dict], autotune: list[dict] = ()) -> str:
    """The generated part of RESULTS.md for one device."""
    parts = [
        f"Run: {meta['date']}, minidp at commit {meta.get('commit', 'unknown')}. Command: `{meta['command']}`",
        f"Machine: {meta['cpu']} ({meta['cores']} cores); GPU: {meta['gpu']}; torch {meta['torch']}; "
        f"backend {meta['backend']}; device {meta['device']}; world sizes {meta['world_sizes']}; "
        f"{meta['threads']} thread(s) per rank; warm-up {meta['warmup']} steps per phase, "
        f"{meta['rounds']} rounds x {meta['steps']} steps per phase (sweep: {meta['sweep_rounds']} rounds).",
        "#### Step time, default settings (bucket_cap_mb=None, gradient_as_bucket_view=False)",
        headline_table(timing),
        "#### Limits: the step against compute-only and all-reduce-only (medians, ms)",
        limits_table(timing),
        "#### gradient_as_bucket_view=True and the bucket_cap_mb sweep",
        variants_table(timing),
    ]
    if autotune:
        parts += ['#### bucket_cap_mb="auto" against every fixed cap (same rounds, minidp; DDP with the chosen cap)',
                  autotune_table(autotune)]
    if memory:
        parts += ["#### Peak memory (separate processes per engine; see Method)", memory_table(memory)]
    if meta.get("plot"):
        parts.append(f"![step time per workload and engine]({meta['plot']})")
    return "\n\n".join(parts)


def write_section(path: str, device: str, text: str) -> None:
    """Put `text` between this device's markers in `path`, keeping everything else in the file."""
    begin, end = f"<!-- BEGIN compare_ddp {device} -->", f"<!-- END compare_ddp {device} -->"
    block = f"{begin}\n{text}\n{end}"
    old = open(path).read() if os.path.exists(path) else "# minidp vs torch DDP: benchmark results\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: block, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def plot_step_times(timing: list[dict], path: str) -> None:
    """Bars of median step time (IQR whiskers) per workload, world size and engine; one panel each."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = [r for r in timing if is_default(r)]
    names = list(dict.fromkeys(r["job"]["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(3.6 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["job"]["workload"] == name]
        for k, (engine, label) in enumerate(ENGINE_LABEL.items()):
            med = [r["phases"][engine]["median"] * 1e3 for r in mine]
            err = [[m - r["phases"][engine]["p25"] * 1e3 for m, r in zip(med, mine)],
                   [r["phases"][engine]["p75"] * 1e3 - m for m, r in zip(med, mine)]]
            xs = [i + (k - 0.5) * 0.38 for i in range(len(mine))]
            ax.bar(xs, med, 0.36, yerr=err, capsize=3, label=label, color=("tab:blue", "tab:gray")[k])
        for i, r in enumerate(mine):
            ax.annotate(f"{r['derived']['ratio']:.2f}x", (i, 0), xytext=(0, 2), textcoords="offset points",
                        ha="center", fontsize=8, color="white")
        ax.set_xticks(range(len(mine)), [f"world {r['world_size']}" for r in mine])
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("step time, ms (median, IQR)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("minidp vs torch DDP (label: minidp/DDP)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
