"""Collectives on many tensors at once: check that ranks agree, broadcast state in flat chunks."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the world)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group=None, src: int = 0,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrite `tensors` on every rank with group rank `src`'s values, a few flat collectives in all.

    Tensors are grouped by dtype and device (keeping their order within a group), packed into flat
    chunks of up to `chunk_bytes`, broadcast once per chunk and unpacked: BatchNorm's float and
    int64 buffers interleave, and packing by run would cost one collective per layer.
    """
    is_src = dist.get_rank(group) == src
    src = global_rank(group, src)
    for chunk in _chunks(tensors, chunk_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        dist.broadcast(flat, src=src, group=group)  # ranks meet here
        if is_src:
            continue  # the source's tensors hold these values already
        with torch.no_grad():
            for t, piece in zip(chunk, flat.split([t.numel() for t in chunk])):
                t.copy_(piece.view_as(t))


def _chunks(tensors, chunk_bytes):
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        chunk, size = [], 0
        for t in group:
            t_size = t.numel() * t.element_size()
            if chunk and size + t_size > chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append(t)
            size += t_size
        if chunk:
            yield chunk


def check_same_across_ranks(what: str, records: list, group=None) -> None:
    """Raise on every rank, naming the first differing entry and the ranks, if ranks disagree.

    Args:
        what: a word for the entries in error messages, e.g. "parameter".
        records: this rank's entries, each a picklable value (e.g. (name, shape, dtype)).
    """
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, records, group=group)  # ranks meet here
    reference = gathered[0]
    differing = [r for r, rec in enumerate(gathered) if rec != reference]
    if not differing:
        return
    first = min(_first_difference(reference, gathered[r]) for r in differing)
    ranks = [r for r in differing if _first_difference(reference, gathered[r]) == first]

    def show(records_of_rank):
        return records_of_rank[first] if first < len(records_of_rank) else "(none: fewer entries)"

    lines = [f"  rank 0: {show(reference)}"] + [f"  rank {r}: {show(gathered[r])}" for r in ranks]
    counts = sorted({len(rec) for rec in gathered})
    raise RuntimeError(
        f"minidp.DDP construction (before iteration 1): ranks {ranks} differ from rank 0 at {what} #{first} "
        f"(entry counts seen: {counts}); every rank must wrap the same model with the same settings, "
        "or their buckets would not match:\n" + "\n".join(lines))


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
