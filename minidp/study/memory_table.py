"""`python -m minidp.simulate --memory`: memory_model.py's prediction as a table (its flags, its output).

    python -m minidp.simulate --memory                                  # the ZeRO paper's Figure 1
    python -m minidp.simulate --memory --params 1.3B --ranks 8 --k 16   # another model, another optimizer
"""
from __future__ import annotations

import argparse
import json

from ..validate import check_int, check_number
from .memory_model import PAPER_FIGURE_1, predict_memory, zero1_beside_ddp

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}  # 7.5B = 7.5e9 parameters
UNITS = (("B", 0), ("kB", 3), ("MB", 6), ("GB", 9), ("TB", 12), ("PB", 15))  # 10^exponent bytes, as the paper


def parse_count(text: str) -> int:
    """A parameter count from '7500000000', '7.5e9' or '7.5B' (suffixes K, M, B or G, T; any case), >= 1.

    Args:
        text: what was typed after --params.
    """
    scale = SUFFIXES.get(text.strip()[-1:].upper(), 1)
    try:
        value = float(text.strip()[:-1] if scale != 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--params={text!r} is not a count: give e.g. 7.5e9 or 7.5B") from None
    count = round(value * scale) if value == value and abs(value) != float("inf") else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"--params={text!r} must be a count of at least 1 parameter")
    return count


def add_memory_arguments(parser) -> None:
    """Add --memory and its flags (--params, --k, --ranks) to simulate's parser."""
    group = parser.add_argument_group("memory (memory_model.py): bytes per rank and sent per step, DDP and "
                                      "ZeRO-1/2/3, the ZeRO paper's model")
    group.add_argument("--memory", action="store_true", help="print the table (default: the paper's Figure 1)")
    group.add_argument("--params", type=parse_count, help="parameters, e.g. 7.5e9 or 7.5B (default 7.5B)")
    group.add_argument("--k", type=float, help="optimizer state bytes per parameter (default 12: mixed-"
                                               "precision Adam's fp32 weights, momentum, variance)")
    group.add_argument("--ranks", type=int, help="data-parallel ranks N (default 64)")


def check_memory_args(parser, args) -> None:
    """Refuse --params/--k/--ranks without --memory; else fill in the paper's Figure 1 for what is missing."""
    given = [f"--{name}" for name in ("params", "k", "ranks") if getattr(args, name) is not None]
    if given and not args.memory:
        parser.error(f"{', '.join(given)} only apply with --memory")
    for name, default in PAPER_FIGURE_1.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    try:
        check_int("--ranks", args.ranks, 1)
        check_number("--k", args.k, low=0)
    except ValueError as e:
        parser.error(str(e))


def format_size(nbytes: float, scale: float) -> str:
    """`nbytes / scale` with one decimal, a trailing .0 dropped: 120e9 -> '120', 31.40625e9 -> '31.4' (GB)."""
    text = f"{nbytes / scale:.1f}"
    return text[:-2] if text.endswith(".0") else text


def format_memory_table(rows: list, params: float, ranks: int, k: float) -> str:
    """predict_memory's rows as a terminal table, the unit (a power of 10) chosen by the largest total."""
    largest = max(max(r["total"], r["sent"]) for r in rows)
    unit, exponent = [u for u in UNITS if 10 ** u[1] <= largest][-1]
    scale, psi = 10 ** exponent, f"{params:.4g}".replace("e+0", "e").replace("e+", "e")
    lines = [f"ZeRO's model: Ψ = {psi} parameters, K = {k:g}, N = {ranks} ranks; per rank, in {unit} "
             f"(10^{exponent} bytes)",
             f"{'':<20}{'weights':>9}{'gradients':>10}{'optimizer':>10}{'total':>8}   {'sent/step':>9}"
             f"{'volume':>8}"]
    for r in rows:
        sizes = [format_size(r[key], scale) for key in ("weights", "gradients", "optimizer", "total", "sent")]
        lines.append(f"{r['name'] + ' (' + r['paper_name'] + ')':<20}{sizes[0]:>9}{sizes[1]:>10}{sizes[2]:>10}"
                     f"{sizes[3]:>8}   {sizes[4]:>9}{str(r['volume']) + 'Ψ':>8}")
    # ZeRO-1 beside DDP: the row above is reduce_scatter=True's; torch's sends a third more
    bcast = format_size(zero1_beside_ddp(params, ranks, k)["broadcast"]["sent"], scale)
    label = "  ZeRO-1, torch's ZeroRedundancyOptimizer (+ broadcasts)"
    lines += [f"{label:<60}{bcast:>9}{'3Ψ':>8}",
              "  (ZeRO-1 above: minidp's ZeroRedundancyOptimizer(reduce_scatter=True), DDP's bytes)"]
    lines += ["volume: the paper's elements a rank moves per step; sent: a ring's (N-1)/N of them, 2 bytes each",
              "measured beside torch's: ZeRO-1 benchmarks/memory/zero.py, ZeRO-2/3 (fully_shard) "
              "benchmarks/memory/fully_shard.py (results in benchmarks/RESULTS.md)"]
    return "\n".join(lines)


def main_memory(args, parser) -> int:
    """`python -m minidp.simulate --memory [--params P] [--k K] [--ranks N] [--json]`."""
    rows = predict_memory(args.params, args.ranks, args.k)
    if args.json:
        print(json.dumps({"params": args.params, "ranks": args.ranks, "k": args.k, "rows": rows}, indent=1))
    else:
        print(format_memory_table(rows, args.params, args.ranks, args.k))
    return 0
