"""Collectives on many tensors at once: broadcast state in flat chunks, check that ranks agree.

Ranks agree or are told where they differ at two times: at construction (`check_same_model`: the
same parameters, buffers and settings), and, in debug mode, at every step (`DesyncCheck`, the
last section: the same iteration, bucket plan and bucket). Only the broadcast runs on a default
step.

Object collectives here run on a device the caller names (the module's), not on torch's choice:
torch.distributed.all_gather_object stages its bytes on torch.cuda.current_device() under NCCL, so
a program that never calls torch.cuda.set_device (torch DDP works without it) would put every rank
on cuda:0.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors  # torch DDP's own helpers

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
            if t.nbytes < DIRECT_BROADCAST_BYTES:
                packed.append(t)
                continue
            flat = t.detach() if t.is_contiguous() else t.detach().contiguous()
            dist.broadcast(flat, src=src, group=group)  # ranks meet here
            if flat.data_ptr() != t.data_ptr() and not is_src:
                t.copy_(flat)
    # Packing and unpacking are one call each (a loop in C++): ResNet-50 has 159 buffers, and a
    # Python loop over them cost 0.4 ms a forward more than torch DDP's broadcast where they unpack.
    with torch.no_grad():
        for chunk in flat_chunks(packed, chunk_bytes):
            flat = _flatten_dense_tensors(chunk)  # one new flat tensor, the chunk back to back
            dist.broadcast(flat, src=src, group=group)  # ranks meet here
            if not is_src:  # the source's tensors hold these values already
                torch._foreach_copy_(chunk, _unflatten_dense_tensors(flat, chunk))


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
            t_size = t.nbytes
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


# ---- debug mode: the per-step check --------------------------------------------------------------
#
# Desync diagnosis: tell which ranks disagree about what they reduce, instead of hanging.
#
# Ranks must issue the same collectives in the same order. When one rank skips a backward, runs
# one step fewer, or builds other buckets, its collectives pair with the wrong ones on the others:
# a hang, an error deep inside gloo/NCCL, or (worst) a silently wrong sum.
#
# Debug mode (`MINIDP_DEBUG=1`, or `minidp.DDP(..., debug=True)`) adds a cheap check: before the
# first collective of each forward and at the first gradient hook of each backward, every rank
# all-gathers a fingerprint (phase, iteration, bucket plan, bucket, size). These always pair with
# each other, so a disagreement is seen by every rank at once and reported with its details.
# Off by default: it costs one small all-gather per forward and per backward.
#
# Under join() a rank whose data has run out still meets every check (join.py has the reducer check
# where a training rank's forward and backward check), with a "joined" fingerprint: it has no
# iteration of its own, so the comparison skips its iteration and checks the rest.

FORWARD, BACKWARD = 1, 2
JOINED = -1  # the iteration in a joined rank's fingerprint (it shadows the others' iterations)
_PHASES = {FORWARD: "forward", BACKWARD: "backward"}
LIKELY_CAUSES = ("a rank skipped a backward, ran a different number of steps, built different "
                 "buckets, or died")


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
    fingerprint = [phase, iteration, plan_hash(plan), -1 if bucket is None else bucket, len(plan)]
    mine = torch.tensor(fingerprint, dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(gathered, mine, group=group)  # ranks meet here
    except RuntimeError as exc:
        first = 0 if bucket is None else bucket
        where = f"bucket {first}" + (f" [{describe_bucket(first)}]" if describe_bucket else "")
        raise RuntimeError(
            f"minidp.DDP consistency check (debug mode) failed on rank {dist.get_rank(group)} at "
            f"iteration {iteration} ({_PHASES[phase]}, before {where}): a peer did not answer, so "
            f"{LIKELY_CAUSES}. Cause: {exc}") from exc
    rows, rows_mine = [g.tolist() for g in gathered], mine.tolist()
    reference, differing = find_differing(rows)
    if differing:
        # Name a bucket's parameters only for ranks whose plan is this rank's (else they would lie).
        same_plan = [row[2] == rows_mine[2] for row in rows]
        lines = [f"  rank {r}: {_describe(row, describe_bucket if same else None)}"
                 for r, (row, same) in enumerate(zip(rows, same_plan))]
        raise RuntimeError(
            f"minidp.DDP consistency check (debug mode): ranks {differing} differ from rank "
            f"{reference} about what they reduce; {LIKELY_CAUSES}.\n" + "\n".join(lines))


class DesyncCheck:
    """Debug mode's check, held by the reducer: every rank all-gathers where it is, what it reduces.

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
    """(reference rank, ranks whose fingerprint differs from it); the reference: the first rank
    still training.

    A joined rank's row (iteration JOINED) is compared without its iteration: it must still be in
    the same phase, with the same bucket plan, at the same bucket.
    """
    reference = next((r for r, row in enumerate(rows) if row[1] != JOINED), 0)

    def without_iteration(row):
        return row[:1] + row[2:]

    expected = rows[reference]
    differing = [r for r, row in enumerate(rows)
                 if (without_iteration(row) != without_iteration(expected) if row[1] == JOINED
                     else row != expected)]
    return reference, differing


def _describe(row: list[int], describe_bucket) -> str:
    phase, iteration, plan, bucket, n_buckets = row
    if phase not in _PHASES:  # its side of the all-gather was some other collective
        return ("sent no minidp fingerprint: it is not in a minidp step (it finished its loop, "
                "e.g. ran fewer steps, or is in another collective)")
    when = "joined (no more data)" if iteration == JOINED else f"iteration {iteration}"
    text = f"{when}, {_PHASES.get(phase, phase)}, bucket plan {plan:#x} ({n_buckets} buckets)"
    if bucket >= 0:
        text += f", launching bucket {bucket}"
        if describe_bucket is not None:
            text += f" [{describe_bucket(bucket)}]"
    return text
