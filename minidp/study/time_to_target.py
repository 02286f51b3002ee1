"""Time to a target loss at N ranks, per communication method, from a measured compression study.

    python benchmarks/compression/study.py               # measures benchmarks/results/compression_study.json
    python -m minidp.simulate --study benchmarks/results/compression_study.json --plot pays_off.png
    python -m minidp.simulate --study ... --validate  # against the times to target measured here (validation.py)

Per method the study file holds: the steps each seed took to reach the target, the warm-up of exact
steps before the method starts (the study's start_iter, or the method's own: DeMo 0, 1-bit Adam its
freeze_step, whose warm-up all-gathers every gradient: its warmup_collectives), the collectives of one
step (op, this rank's input bytes, how often per step, whether the input shrinks as 1/N, and how many
compute steps it overlaps: Streaming DiLoCo's sync runs beside its next sync_delay inner steps), and
cost_s, what compress, decompress and memory (or the method's own optimizer) add to a step on the
measuring machine at world size 1, payload_cost_s, what each more rank's payload adds (a method that
all-gathers decompresses every rank's payload); and, once, compute_s: a step with no communication. Then

    step(N)  = busy + sum over collectives of per_step * max(0, time(op, bytes, N) - overlap_steps * busy)
    busy     = compute + cost_s + (N - 1) payload_cost_s   (with shared cores nothing overlaps)
    time     = (warmup - 1) * step_warmup(N) + (steps_to_target - warmup) * step(N)

step_warmup is exact's step, or the method's with its warmup_collectives where it has them (the first
step, with its one-time set-up of buckets and groups, is left out here and in the measured times; with no
warm-up, steps_to_target - 1 steps of the method)

with the collective times of the alpha-beta model (latency a per message, b seconds per byte):
all-reduce from network.allreduce_time (ring or tree); all-gather, ring: (N - 1) a + (N - 1) P b,
since each rank receives every other rank's payload P; all-to-all, pairwise: (N - 1) a +
(N - 1) / N S b for an input of S bytes. A ring across nodes runs at its slowest link.

Assumptions: nothing overlaps but what a method overlaps itself (communication after backward; near
enough when the gradients fill one or two buckets, as in the study, and pessimistic for exact on big
models, whose all-reduces hide behind backward); the per-rank batch stays as measured (weak scaling)
and so do the steps to the target, though a larger global batch changes them, for each method
differently; every rank computes alike.
"""
from __future__ import annotations

import json
import math
import statistics

from ..validate import check_int, check_number
from .network import Link, Network, allreduce_time

BANDWIDTHS_GBIT = (10, 25, 100, 400)
STUDY_WORLD_SIZES = tuple(2 ** k for k in range(3, 11))  # 8 ... 1,024
OPS = ("all_reduce", "all_gather", "all_to_all")
SCALES = ("fixed", "chunk")


def flat_network(gbit: float, latency_us: float = 15.0, algorithm: str = "ring") -> Network:
    """Every rank on its own node, one kind of link: `gbit` Gb/s and `latency_us` per message."""
    check_number("gbit", gbit, positive=True)
    link = Link(latency_us * 1e-6, gbit * 1e9 / 8)
    return Network(link, link, ranks_per_node=1, algorithm=algorithm)


def collective_time(op: str, nbytes: float, world_size: int, net: Network) -> float:
    """Seconds for one collective of this rank's `nbytes` input over `world_size` ranks (0 for one rank)."""
    if op not in OPS:
        raise ValueError(f"op={op!r}: choose from {OPS}")
    n = check_int("world_size", world_size, 1)
    if n == 1 or nbytes <= 0:
        return 0.0
    if op == "all_reduce":
        return allreduce_time(nbytes, n, net)
    link = net.intra if n <= net.ranks_per_node else Link(max(net.intra.latency_s, net.inter.latency_s),
                                                          min(net.intra.bandwidth, net.inter.bandwidth))
    if op == "all_gather":
        return (n - 1) * (link.latency_s + nbytes / link.bandwidth)
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth


def comm_time(method: dict, world_size: int, net: Network, study_world: int, busy_s: float = 0.0,
              collectives: list | None = None) -> float:
    """One step's communication: each collective at its frequency, inputs rescaled to world_size
    ("chunk": 1/N of the data; "fixed": the same).

    A collective with overlap_steps k runs beside k steps of `busy_s` compute (not with net.shared_cores);
    only what is left of it counts. collectives: default the method's.
    """
    total = 0.0
    for c in method["collectives"] if collectives is None else collectives:
        if c["scale"] not in SCALES:
            raise ValueError(f"collective {c}: scale={c['scale']!r}, choose from {SCALES}")
        nbytes = c["bytes"] * (study_world / world_size if c["scale"] == "chunk" else 1)
        hidden = 0.0 if net.shared_cores else c.get("overlap_steps", 0) * busy_s
        total += c["per_step"] * max(0.0, collective_time(c["op"], nbytes, world_size, net) - hidden)
    return total


def step_time(study: dict, name: str, world_size: int, net: Network, compute_s: float | None = None,
              compute_scale: float = 1.0, warmup: bool = False, sync_s: float = 0.0,
              compute_1_s: float | None = None) -> float:
    """Predicted seconds of one step of method `name` (after its warm-up) at `world_size` ranks.

    Args:
        compute_s: the compute of a step. Default None: the study's at world size 1 (study["compute_s"]["1"]).
        compute_scale: multiplies compute and the method's cost (e.g. 0.02 for a processor 50x faster). Default 1.
        warmup: a step of the method's own warm-up (its warmup_collectives) instead. Default False.
        sync_s: what bringing the ranks into step costs, once in each step that communicates (the
            validation's second prediction: ranks sharing cores arrive at a step's first collective
            apart). Default 0.
        compute_1_s: the compute of the same per-rank batch at world size 1, which compute_s is a
            slowdown of. Default None: study["compute_s"]["1"] (the study's per-rank batch).
    """
    compute = study["compute_s"]["1"] if compute_s is None else compute_s
    alone = study["compute_s"]["1"] if compute_1_s is None else compute_1_s
    scale = compute_scale * compute / alone  # the method's cost slows down as the compute does
    method = study["methods"][name]
    # the cost measured at world size 1 aggregated one payload; each more rank's adds payload_cost_s
    cost = max(0.0, method["cost_s"]) + (world_size - 1) * method.get("payload_cost_s", 0.0)
    busy = compute * compute_scale + cost * scale
    collectives = method["warmup_collectives"] if warmup else method["collectives"]
    communicating = min(1.0, max((c["per_step"] for c in collectives), default=0))
    return busy + sync_s * communicating + comm_time(method, world_size, net, study["world_size"], busy, collectives)


def time_to_target(study: dict, name: str, world_size: int, net: Network, steps: list | None = None,
                   **step_kwargs) -> list:
    """Predicted seconds to the target, one per seed (None where that seed never reached it).

    steps: the steps to the target to predict for. Default None: the method's, one per seed.
    """
    method = study["methods"][name]
    warm = method.get("start_iter", study["start_iter"])
    own = "warmup_collectives" in method
    warm_step = step_time(study, name if own else "exact", world_size, net, warmup=own, **step_kwargs)
    step = step_time(study, name, world_size, net, **step_kwargs)
    out = []
    for s in method["steps_to_target"] if steps is None else steps:
        if s is None:
            out.append(None)
            continue
        warm_steps = max(0, min(s, warm) - 1)  # the first step left out, as in the measured times
        out.append(warm_steps * warm_step + (s - 1 - warm_steps) * step)
    return out


def summarize(times: list) -> tuple:
    """(median, min, max) over seeds; a seed that never reached the target counts as infinite."""
    values = sorted(math.inf if t is None else t for t in times)
    return statistics.median(values), values[0], values[-1]


def relative_table(study: dict, world_sizes=STUDY_WORLD_SIZES, bandwidths=BANDWIDTHS_GBIT,
                   latency_us: float = 15.0, compute_scale: float = 1.0, algorithm: str = "ring") -> dict:
    """{(gbit, N): {method: (median, min, max) time to target over exact's median}}."""
    out = {}
    for gbit in bandwidths:
        net = flat_network(gbit, latency_us, algorithm)
        for n in world_sizes:
            exact = summarize(time_to_target(study, "exact", n, net, compute_scale=compute_scale))[0]
            if math.isinf(exact):
                raise ValueError("exact never reached the target in the study (in most seeds): nothing to compare with")
            out[(gbit, n)] = {m: tuple(t / exact for t in summarize(time_to_target(study, m, n, net,
                                                                                    compute_scale=compute_scale)))
                              for m in study["methods"]}
    return out


def fastest(cells: dict) -> tuple:
    """(method, speed-up over exact) of one table cell: the lowest median time to target."""
    name = min(cells, key=lambda m: cells[m][0])
    return name, 1.0 / cells[name][0]


def _fmt(cell: tuple) -> str:
    med, low, high = cell
    if math.isinf(med):
        return "never"
    return f"{med:.2f} ({low:.2f}-{'inf' if math.isinf(high) else f'{high:.2f}'})"


def format_table(study: dict, table: dict) -> str:
    """Per bandwidth, methods x world sizes: time to target over exact's, median (seeds' min-max)."""
    lines = []
    sizes = sorted({n for _, n in table})
    name_w = max(16, *(len(m) + 1 for m in study["methods"]))  # names as long as "Streaming DiLoCo ..." fit
    cell_w = max(21, *(len(m) + 8 for m in study["methods"]))
    for gbit in sorted({g for g, _ in table}):
        lines += ["", f"{gbit:g} Gb/s: time to target / exact's (median over seeds, min-max)",
                  f"{'method':<{name_w}}" + "".join(f"{n:>{cell_w}}" for n in sizes)]
        for m in study["methods"]:
            lines.append(f"{m:<{name_w}}" + "".join(f"{_fmt(table[(gbit, n)][m]):>{cell_w}}" for n in sizes))
        best = [fastest(table[(gbit, n)]) for n in sizes]
        lines.append(f"{'fastest':<{name_w}}" + "".join(f"{f'{name} x{up:.2f}':>{cell_w}}" for name, up in best))
    return "\n".join(lines[1:])


def load(path: str) -> dict:
    """A study file, checked for what the predictions read."""
    with open(path) as f:
        study = json.load(f)
    missing = [k for k in ("methods", "compute_s", "start_iter", "world_size") if k not in study]
    if missing:
        raise ValueError(f"--study {path}: no {missing} "
                         "(write it with benchmarks/compression/study.py --phases report)")
    if "exact" not in study["methods"]:
        raise ValueError(f"--study {path}: no 'exact' method to compare with")
    for method in study["methods"].values():  # 2026-12-04's files also list minidp.DDP's status all-reduce
        method["collectives"] = [c for c in method["collectives"] if not c.get("engine")]  # gone since 3bb5da5
    return study


def plot_fastest(path: str, table: dict, title: str) -> None:
    """World size x bandwidth, each cell coloured by its fastest method and labelled with its speed-up."""
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    sizes, gbits = sorted({n for _, n in table}), sorted({g for g, _ in table})
    best = {key: fastest(cells) for key, cells in table.items()}
    names = sorted({name for name, _ in best.values()}, key=lambda m: list(next(iter(table.values()))).index(m))
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(1.0 * len(sizes) + 2.5, 0.7 * len(gbits) + 2.2))
    for i, n in enumerate(sizes):
        for j, g in enumerate(gbits):
            name, up = best[(g, n)]
            ax.add_patch(plt.Rectangle((i - 0.5, j - 0.5), 1, 1, color=colours(names.index(name) % 10), alpha=0.75))
            ax.text(i, j, f"x{up:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_ylim(-0.5, len(gbits) - 0.5)
    ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    ax.set_yticks(range(len(gbits)), [f"{g:g}" for g in gbits])
    ax.set_xlabel("ranks")
    ax.set_ylabel("link bandwidth, Gb/s")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=colours(k % 10), alpha=0.75, label=m) for k, m in enumerate(names)],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, title="fastest to target", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
