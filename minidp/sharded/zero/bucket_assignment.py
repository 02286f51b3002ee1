"""overlap_with_ddp=True's partition: which rank steps which part of which DDP bucket.

Pure functions over lists of tensors (no process group), as partition.py's: every rank computes
the same answer from the same buckets without a collective, and tests check it without processes.
The unit of ownership is DDP's bucket, not the parameter (torch's ddp_zero_hook rule): bucket i,
whole, to rank i % N; or, with shard_buckets=True, buckets cut into pieces of about 1/N of the
model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Assignment:
    """Parameters of one DDP bucket that one rank steps (torch's _DDPBucketAssignment).

    offset: the index of params[0] in the bucket's parameters() (and gradients()).
    flat: the params' data back to back (the params are views into it): what one broadcast sends.
    """
    bucket: int
    params: list
    offset: int
    flat: torch.Tensor | None = None


def assign_buckets(params_per_bucket: list[list], world_size: int,
                   shard_buckets: bool) -> list[dict]:
    """Per rank, {bucket index: Assignment}, in the order torch assigns them.

    shard_buckets=False: bucket i, whole, to rank i % world_size. True: buckets in increasing size
    (a stable sort); each is cut, in parameter order, into pieces that stop before the parameter
    that would reach total/world_size elements; each piece goes to the rank with the fewest elements
    so far that has no piece of this bucket yet (the lowest such rank on a tie).
    """
    out: list[dict[int, Assignment]] = [{} for _ in range(world_size)]
    if not shard_buckets:
        for b, params in enumerate(params_per_bucket):
            out[b % world_size][b] = Assignment(b, list(params), 0)
        return out
    threshold = sum(p.numel() for ps in params_per_bucket for p in ps) / world_size
    loads = [0] * world_size
    by_size = sorted(enumerate(params_per_bucket), key=lambda bp: sum(p.numel() for p in bp[1]))
    for b, params in by_size:
        pieces = cut_bucket(params, threshold)
        if len(pieces) > world_size:  # torch: AssertionError("All indices are disallowed")
            raise RuntimeError(f"shard_buckets=True: bucket {b} would be cut into {len(pieces)} "
                               f"pieces for {world_size} ranks (each piece stops below "
                               f"{threshold:g} elements, 1/N of the model); use "
                               "shard_buckets=False or larger buckets")
        taken: set[int] = set()
        for first, end, piece_size in pieces:
            rank = min((r for r in range(world_size) if r not in taken), key=lambda r: loads[r])
            out[rank][b] = Assignment(b, list(params[first:end]), first)
            taken.add(rank)
            loads[rank] += piece_size
    return out


def cut_bucket(params: list, threshold: float) -> list[tuple[int, int, int]]:
    """(first, end, elements) of each piece of a bucket's `params`, in order: a piece ends before
    the parameter that would bring it to `threshold` elements (a piece holds one at least)."""
    pieces = []
    start, size = 0, 0
    for i, p in enumerate(params):
        if size + p.numel() >= threshold and i > start:
            pieces.append((start, i, size))
            start, size = i, 0
        size += p.numel()
    pieces.append((start, len(params), size))
    return pieces


def params_of(per_rank: dict[int, Assignment]) -> list[torch.Tensor]:
    """A rank's parameters, assignment after assignment: its local optimizer's order."""
    return [p for a in per_rank.values() for p in a.params]
