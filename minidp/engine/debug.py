"""Desync diagnosis: tell which ranks disagree about what they reduce, instead of hanging.

Ranks must issue the same collectives in the same order. When one rank skips a backward, runs
one step fewer, or builds other buckets, its collectives pair with the wrong ones on the others:
a hang, an error deep inside gloo/NCCL, or (worst) a silently wrong sum.

Debug mode (`MINIDP_DEBUG=1`, or `minidp.DDP(..., debug=True)`) adds a cheap check: before the
first collective of each forward and at the first gradient hook of each backward, every rank
all-gathers a fingerprint (phase, iteration, bucket plan, bucket, size). These always pair with
each other, so a disagreement is seen by every rank at once and reported with its details.
Off by default: it costs one small all-gather per forward and per backward.

Under join() a rank whose data has run out still meets every check (join.py has the reducer check
where a training rank's forward and backward check), with a "joined" fingerprint: it has no
iteration of its own, so the comparison skips its iteration and checks the rest.
"""
from __future__ import annotations

import os
import zlib

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 1, 2
JOINED = -1  # the iteration in a joined rank's fingerprint (it shadows the others' iterations)
_PHASES = {FORWARD: "forward", BACKWARD: "backward"}
LIKELY_CAUSES = ("a rank skipped a backward, ran a different number of steps, built different buckets, "
                 "or died")


def debug_from_env() -> bool:
    """MINIDP_DEBUG=1 (or true/yes) turns the per-step consistency check on."""
    return os.environ.get("MINIDP_DEBUG", "0").strip().lower() in ("1", "true", "yes", "on")


def plan_hash(plan: list[list[int]]) -> int:
    return zlib.crc32(repr(plan).encode()) & 0x7FFFFFFF


def check(phase: int, iteration: int, plan: list[list[int]], group, device, bucket=None,
          describe_bucket=None) -> None:
    """All-gather this rank's fingerprint and raise on every rank if any rank differs.

    Args:
        phase: FORWARD or BACKWARD.
        iteration: the synced iteration this step belongs to (1 for the first).
        plan: the bucket plan (parameter indices per bucket).
        bucket: index of the bucket about to be launched (backward only).
        describe_bucket: function(bucket index) -> text naming its parameters.
    """
    mine = torch.tensor([phase, iteration, plan_hash(plan), -1 if bucket is None else bucket, len(plan)],
                        dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(gathered, mine, group=group)  # ranks meet here
    except RuntimeError as exc:
        first = 0 if bucket is None else bucket
        where = f"bucket {first} [{describe_bucket(first)}]" if describe_bucket else f"bucket {first}"
        raise RuntimeError(
            f"minidp.DDP consistency check (debug mode) failed on rank {dist.get_rank(group)} at iteration "
            f"{iteration} ({_PHASES[phase]}, before {where}): a peer did not answer, so {LIKELY_CAUSES}. "
            f"Cause: {exc}") from exc
    rows, rows_mine = [g.tolist() for g in gathered], mine.tolist()
    reference, differing = find_differing(rows)
    if differing:
        # Name a bucket's parameters only for ranks whose plan is this rank's (else the names would lie).
        lines = [f"  rank {r}: {_describe(row, describe_bucket if row[2] == rows_mine[2] else None)}"
                 for r, row in enumerate(rows)]
        raise RuntimeError(
            f"minidp.DDP consistency check (debug mode): ranks {differing} differ from rank {reference} about "
            f"what they reduce; {LIKELY_CAUSES}.\n" + "\n".join(lines))


class DesyncCheck:
    """Debug mode's check, held by the reducer: every rank all-gathers where it is and what it reduces.

    Args:
        group: the reducer's process group. Nothing is checked at world size 1.
    """

    def __init__(self, group):
        self.group = group
        self.alone = dist.get_world_size(group) == 1  # one rank agrees with itself

    def check(self, phase: int, iteration: int, names: list[str], plan: list[list[int]],
              device) -> None:
        """Raise on every rank if any rank differs (ranks meet here).

        Args:
            phase: FORWARD (before a syncing forward's collectives; `iteration` is the one it
                starts) or BACKWARD (at the first hook; the one under way, launching bucket 0).
            iteration: as above, or JOINED for a rank that has joined (join.py).
            names, plan: the reducer's parameter names and bucket plan. device: where to gather.
        """
        if self.alone:
            return
        bucket = 0 if phase == BACKWARD else None
        check(phase, iteration, plan, self.group, device, bucket,
              lambda index: describe_bucket(names, plan, index))  # ranks meet here


def describe_bucket(names: list[str], plan: list[list[int]], index: int) -> str:
    """A bucket's parameters, for error messages: "3 parameter(s): fc.weight, fc.bias, ..."."""
    names = [names[i] for i in plan[index]]
    shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
    return f"{len(names)} parameter(s): {', '.join(shown)}"


def find_differing(rows: list[list[int]]) -> tuple[int, list[int]]:
    """(reference rank, ranks whose fingerprint differs from it): the reference is the first training rank.

    A joined rank's row (iteration JOINED) is compared without its iteration: it must still be in the
    same phase, with the same bucket plan, at the same bucket.
    """
    reference = next((r for r, row in enumerate(rows) if row[1] != JOINED), 0)

    def without_iteration(row):
        return row[:1] + row[2:]

    expected = rows[reference]
    differing = [r for r, row in enumerate(rows) if (without_iteration(row) != without_iteration(expected)
                                                     if row[1] == JOINED else row != expected)]
    return reference, differing


def _describe(row: list[int], describe_bucket) -> str:
    phase, iteration, plan, bucket, n_buckets = row
    if phase not in _PHASES:  # its side of the all-gather was some other collective
        return ("sent no minidp fingerprint: it is not in a minidp step (it finished its loop, e.g. ran "
                "fewer steps, or is in another collective)")
    when = "joined (no more data)" if iteration == JOINED else f"iteration {iteration}"
    text = f"{when}, {_PHASES.get(phase, phase)}, bucket plan {plan:#x} ({n_buckets} buckets)"
    if bucket >= 0:
        text += f", launching bucket {bucket}"
        if describe_bucket is not None:
            text += f" [{describe_bucket(bucket)}]"
    return text
