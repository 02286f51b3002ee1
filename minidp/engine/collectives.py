"""Collectives on many tensors at once: check that ranks agree, broadcast state in flat chunks.

Object collectives here run on a device the caller names (the module's), not on torch's choice:
torch.distributed.all_gather_object stages its bytes on torch.cuda.current_device() under NCCL, so
a program that never calls torch.cuda.set_device (torch DDP works without it) would put every rank
on cuda:0.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import torch
import torch.distributed as dist

BROADCAST_CHUNK_BYTES = 250 * 1024 * 1024  # DDP's broadcast_bucket_size
DIRECT_BROADCAST_BYTES = 1024 * 1024  # a contiguous tensor this large: broadcast in place, unpacked
PICKLE_PROTOCOL = 4  # fixed, so equal records pickle (and hash) alike on every rank


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (None: the world)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def broadcast_coalesced(tensors: Sequence[torch.Tensor], group=None, src: int = 0,
                        chunk_bytes: int = BROADCAST_CHUNK_BYTES) -> None:
    """Overwrite `tensors` on every rank with group rank `src`'s values, in a few flat collectives.

    Small tensors are grouped by dtype and device (keeping their order within a group), packed into
    flat chunks of up to `chunk_bytes`, broadcast once per chunk and unpacked: BatchNorm's float and
    int64 buffers interleave, and packing by run would cost one collective per layer. A tensor of
    DIRECT_BROADCAST_BYTES or more is broadcast on its own, in place when contiguous: one collective
    more, two copies of it fewer (packing on the source, unpacking elsewhere). Ranks decide by size
    alone, never by strides: their tensors have the same shapes (checked at construction), so they
    issue the same collectives.
    """
    if dist.get_world_size(group) == 1:
        return  # one rank: it is the source
    is_src = dist.get_rank(group) == src
    src = global_rank(group, src)
    packed = []
    with torch.no_grad():
        for t in tensors:
            if t.numel() * t.element_size() < DIRECT_BROADCAST_BYTES:
                packed.append(t)
                continue
            flat = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(flat, src=src, group=group)  # ranks meet here
            if flat.data_ptr() != t.data_ptr() and not is_src:
                t.copy_(flat)
    for chunk in flat_chunks(packed, chunk_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        dist.broadcast(flat, src=src, group=group)  # ranks meet here
        if is_src:
            continue  # the source's tensors hold these values already
        with torch.no_grad():
            for t, piece in zip(chunk, flat.split([t.numel() for t in chunk])):
                t.copy_(piece.view_as(t))


def flat_chunks(tensors: Sequence[torch.Tensor], chunk_bytes: int = BROADCAST_CHUNK_BYTES):
    """Yield lists of tensors that pack into one flat buffer: same dtype and device, <= chunk_bytes.

    Tensors keep their order within a (dtype, device) group; a tensor larger than chunk_bytes gets
    a chunk of its own. Used by broadcast_coalesced and join's broadcast_from_last_trainer.
    """
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


def collective_device(group=None, device=None) -> torch.device:
    """Where to stage tensors for a collective on `group`: the CPU, unless the backend is NCCL.

    NCCL takes CUDA tensors only: there `device` when it is a CUDA device (pass the module's),
    else the current CUDA device, as torch does. Gloo and the others take CPU tensors, no copy
    needed.

    Args:
        group: the process group. Default None: the world.
        device: the device the caller's tensors live on (e.g. the module's). Default None.
    """
    if dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def all_gather_objects(obj, group=None, device=None) -> list:
    """Every rank's `obj` (picklable), in group-rank order; all_gather_object on a chosen device.

    Args:
        obj: this rank's value.
        group: the process group. Default None: the world.
        device: staged on collective_device(group, device). Default None.
    """
    device = collective_device(group, device)
    payload = bytearray(pickle.dumps(obj, protocol=PICKLE_PROTOCOL))
    world = dist.get_world_size(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)  # ranks meet here: how many bytes each rank sends
    sizes = torch.cat(sizes).tolist()
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[:len(payload)] = torch.frombuffer(payload, dtype=torch.uint8)
    mine = mine.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)  # ranks meet here: the pickled objects, padded
    return [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, sizes)]


def check_same_across_ranks(what: str, records: list, group=None, device=None) -> None:
    """Raise on every rank, naming the first differing entry and the ranks, if ranks disagree.

    Ranks first compare a digest of their pickled records: one all-reduce of two integers (the
    largest digest and the largest negated one, i.e. the smallest); only when the digests differ do
    they gather the records themselves to say where.

    Args:
        what: a word for the entries in error messages, e.g. "parameter".
        records: this rank's entries, each a picklable value (e.g. (name, shape, dtype)).
        group: the process group. Default None: the world.
        device: where to stage the collectives under NCCL; pass the module's device. Default None
            (the current CUDA device under NCCL; the CPU under gloo).
    """
    if dist.get_world_size(group) == 1:
        return  # one rank agrees with itself
    device = collective_device(group, device)
    sha = hashlib.sha256(pickle.dumps(records, protocol=PICKLE_PROTOCOL)).digest()
    # 62 bits: non-negative, and its negation fits an int64
    digest = int.from_bytes(sha[:8], "little") >> 2
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)  # ranks meet here: 16 bytes
    largest, minus_smallest = extremes.tolist()
    if largest == -minus_smallest:  # every rank's digest is the same
        return
    # Every rank saw the same extremes, so every rank comes here. Equal records may still pickle
    # differently (pickle shares repeated objects by identity): compare the records themselves.
    gathered = all_gather_objects(records, group, device)  # ranks meet here
    _raise_if_different(what, gathered)


def _raise_if_different(what: str, gathered: list) -> None:
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
        f"minidp.DDP construction (before iteration 1): ranks {ranks} differ from rank 0 at "
        f"{what} #{first} (entry counts seen: {counts}); every rank must wrap the same model with "
        "the same settings, or their buckets would not match:\n" + "\n".join(lines))


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_same_model(params: list, buffers: list, settings: list, group=None) -> None:
    """Every rank must wrap the same parameters and buffers with the same settings; says where not.

    Args:
        params, buffers: (name, tensor) pairs. settings: "keyword=value" strings that shape the
            buckets.
    """
    records = [("parameter", n, tuple(p.shape), str(p.dtype)) for n, p in params]
    records += [("buffer", n, tuple(b.shape), str(b.dtype)) for n, b in buffers]
    records.append(("settings", *settings))
    # A differing setting (e.g. bucket_cap_mb) would give different buckets from iteration 2 on, and
    # sums of unrelated gradients: refuse before iteration 1.
    device = next((p.device for _, p in params), None)  # under NCCL: on the module's GPU
    # ranks meet here
    check_same_across_ranks("parameter/buffer/setting", records, group, device=device)
