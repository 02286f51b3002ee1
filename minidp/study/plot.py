"""Drawings for studying a step: recorded timelines (one panel per rank) and scaling curves.

matplotlib is imported inside the functions: recording a timeline never needs it. The timeline's
span helpers (which import torch) too: `python -m minidp.simulate --plot` draws without torch.
"""
from __future__ import annotations

import os
import tempfile


def check_writable(flag: str, path: str, folder: bool = False) -> str:
    """Make sure `path` (a file, or a folder when `folder`) can be written, before any work; return it.

    Creates the missing folders, then really creates a file there (removed at once): os.access says yes to
    root where the write fails. Raises ValueError naming the flag, the path and why, so that a run of minutes
    does not end in an OSError when its first file is written.
    """
    where = path if folder else (os.path.dirname(path) or ".")
    try:
        if not folder and os.path.isdir(path):
            raise IsADirectoryError(21, "it is a folder; give a file name")
        os.makedirs(where, exist_ok=True)
        if folder or not os.path.exists(path):
            tempfile.TemporaryFile(dir=where).close()
        else:
            open(path, "ab").close()  # an existing file: opened to append, left as it is
    except FileExistsError:  # os.makedirs: the folder's name is a file's
        raise ValueError(f"{flag}={path!r} cannot be written: {where!r} is a file, not a folder") from None
    except OSError as e:
        raise ValueError(f"{flag}={path!r} cannot be written: {e.strerror or e}") from None
    return path


def plot_timelines(path: str, events_by_rank: dict, title: str = "") -> None:
    """A PNG with one panel per rank: step phases, gradient-ready ticks, one bar per bucket's all-reduce."""
    import matplotlib  # lazily: recording never needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minidp.engine.timeline import bucket_spans, named_spans
    t0 = min((e[1] for events in events_by_rank.values() for e in events), default=0)
    n_buckets = max((s["bucket"] + 1 for ev in events_by_rank.values() for s in bucket_spans(ev)), default=0)
    extra = sorted({lane for ev in events_by_rank.values() for lane, *_ in named_spans(ev)})
    lanes = 2 + n_buckets + len(extra)
    fig, axes = plt.subplots(len(events_by_rank), 1, sharex=True, squeeze=False,
                             figsize=(10, 0.9 + 0.42 * lanes * len(events_by_rank)))
    for ax, (rank, events) in zip(axes[:, 0], events_by_rank.items()):
        _draw_rank(ax, events, t0, n_buckets, _bucket_colors(plt, n_buckets), extra)
        ax.set_ylabel(f"rank {rank}", fontsize=9)
    axes[-1, 0].set_xlabel("time since the first event, ms")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=4, framealpha=0.8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _bucket_colors(plt, n_buckets):
    """Bucket b -> a colour from a sequential map, distinct from the pale colours of the step phases."""
    cmap = plt.get_cmap("viridis")
    return lambda b: cmap(0.85 * b / max(1, n_buckets - 1))


def _draw_rank(ax, events, t0, n_buckets, color, extra=()) -> None:
    """Lanes, top to bottom: step phases, gradients ready (coloured by bucket), bucket 0, 1, ...,
    then the `extra` lanes of begin/end spans (e.g. ZeRO's steps and broadcasts inside backward)."""
    from minidp.engine.timeline import bucket_spans, named_spans, step_spans
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731 - a one-line unit conversion
    phase_colors = {"forward": "#c7e9c0", "backward": "#fdd0a2", "optimizer": "#dadaeb"}
    for name, start, end in step_spans(events):
        ax.barh(0, ms(end) - ms(start), left=ms(start), height=0.6, label=name.split(" ")[0],
                color=phase_colors.get(name, "lightgray"), edgecolor="black", linewidth=0.3)
    ticks = [(ms(stamp), f["bucket"]) for kind, stamp, f in events if kind == "grad_ready"]
    ax.scatter([t for t, _ in ticks], [1] * len(ticks), marker="|", s=120,
               c=[color(b) for _, b in ticks], linewidths=0.8)
    for span in bucket_spans(events):
        y = 2 + span["bucket"]
        if span["done"] is not None:
            ax.barh(y, ms(span["done"]) - ms(span["launch"]), left=ms(span["launch"]), height=0.6,
                    color=color(span["bucket"]), edgecolor="black", linewidth=0.3)
        if span["last_ready"] is not None:
            ax.plot([ms(span["last_ready"])], [y], marker=">", color="black", markersize=4)
    for lane, _, start, end in named_spans(events):  # spans of one lane may overlap: see-through
        ax.barh(2 + n_buckets + list(extra).index(lane), ms(end) - ms(start), left=ms(start), height=0.6,
                color="#6a51a3", alpha=0.45, edgecolor="black", linewidth=0.3)
    labels = ["step", "grads ready"] + [f"bucket {b}" for b in range(n_buckets)] + list(extra)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.4, -0.6)  # first lane on top
    ax.grid(axis="x", alpha=0.3)


def plot_scaling(path: str, rows: list, title: str = "") -> None:
    """Predicted step time (left) and hidden share / scaling efficiency (right) against ranks (log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["world_size"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(ranks, [1e3 * r["step_s"] for r in rows], marker="o", label="step")
    left.plot(ranks, [1e3 * r["compute_s"] for r in rows], linestyle="--", color="gray", label="compute alone")
    left.set_ylabel("ms per step")
    left.set_ylim(bottom=0)
    right.plot(ranks, [100 * r["efficiency"] for r in rows], marker="o", label="scaling efficiency")
    right.plot(ranks, [None if r["hidden"] is None else 100 * r["hidden"] for r in rows], marker="s",
               label="communication hidden")
    right.set_ylabel("%")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
