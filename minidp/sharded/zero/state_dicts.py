"""Checkpoints of a sharded optimizer: gather the shards' states on one rank, merge, split again.

Each rank's local optimizer numbers its parameters locally (0, 1, ... over its own shard). A
checkpoint must not depend on the world size, so the consolidated state dict numbers them as a
plain optimizer over all the parameters would: in parameter-group order. `merge` renumbers local to
global; `local_state` picks out, on load, the entries of the parameters this rank steps. The format
is torch.optim.Optimizer's and torch ZeroRedundancyOptimizer's, so checkpoints move between them.
"""
from __future__ import annotations

import io
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from ...engine.collectives import collective_device, global_rank
from . import partition


def copy_to(value: Any, device: torch.device) -> Any:
    """A copy of `value` with every tensor in it copied to `device` (lists, tuples, dicts walked).

    Always a copy, even on the same device: a consolidated checkpoint must not change when the
    optimizer steps on, nor a loaded state alias the caller's dict.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: copy_to(v, device) for k, v in value.items()}
    return value


def _send_object(obj: Any, dst: int, group, device: torch.device) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.send(size, dst=dst, group=group)  # ranks meet here: the receiver learns the length first
    dist.send(payload, dst=dst, group=group)  # ranks meet here: the pickled state


def _recv_object(src: int, group, device: torch.device) -> Any:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src, group=group)  # ranks meet here: the sender's length
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=src, group=group)  # ranks meet here: the sender's pickled state
    # weights_only=False: a local optimizer's state may hold any picklable value, and it comes from
    # a rank of this same job, not from a file
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu",
                      weights_only=False)


def gather_on(obj: Any, to: int, group, device: torch.device) -> list:
    """Every rank's `obj` on group rank `to`, in group-rank order, on the CPU; [] on the others.

    Point to point: each other rank sends once, to `to` only (torch broadcasts each state to every
    rank instead, which costs world_size times the traffic on gloo). Call on every rank of `group`.

    Args:
        obj: this rank's local state dict (anything torch.save can write).
        to: the group rank that receives.
        group: the process group.
        device: where the bytes travel: the CPU under gloo, a CUDA device under NCCL
            (collective_device picks it from the parameters' device).
    """
    device = collective_device(group, device)
    rank = dist.get_rank(group)
    if rank != to:
        _send_object(obj, global_rank(group, to), group, device)
        return []
    # the receiver takes the senders in rank order; each sender sends once, so no one waits in a
    # cycle
    return [copy_to(obj, torch.device("cpu")) if r == rank
            else _recv_object(global_rank(group, r), group, device)
            for r in range(dist.get_world_size(group))]


def merge(base: dict, local_state_dicts: list[dict], partition: list[list[dict]],
          param_groups: list[dict]) -> dict:
    """The global state dict: `base` (Optimizer.state_dict() of the wrapper: the groups, numbered
    globally) with every rank's local states renumbered into it, sorted by global index.

    Args:
        base: the wrapper's own state dict, whose "param_groups" hold global indices.
        local_state_dicts: each rank's local optimizer state dict, in rank order.
        partition: the partition the local states were made with (rank -> groups).
        param_groups: the wrapper's groups (global numbering: group order, then parameter order).
    """
    index = {p: i for i, p in enumerate(chain.from_iterable(g["params"] for g in param_groups))}
    for rank, local in enumerate(local_state_dicts):
        shard_groups = partition[rank]
        if len(local["param_groups"]) != len(shard_groups):
            raise RuntimeError(f"rank {rank}'s consolidated state has "
                               f"{len(local['param_groups'])} parameter groups, the optimizer "
                               f"has {len(shard_groups)} now: call consolidate_state_dict() again "
                               "after add_param_group()")
        for local_group, shard_group in zip(local["param_groups"], shard_groups):
            if len(local_group["params"]) != len(shard_group["params"]):
                raise RuntimeError(f"rank {rank}'s consolidated state does not match its shard "
                                   "now: call consolidate_state_dict() again after "
                                   "add_param_group()")
            for local_index, param in zip(local_group["params"], shard_group["params"]):
                if local_index in local["state"]:
                    base["state"][index[param]] = local["state"][local_index]
    base["state"] = dict(sorted(base["state"].items()))
    return base


def local_state(state: dict, param_groups: list[dict], owner: dict, rank: int) -> dict:
    """{parameter: its state, on the parameter's device} for the `state` entries `rank` steps.

    Zero-dimensional tensors (Adam's "step") go to the CPU, where the optimizers keep them unless
    capturable. Raises IndexError naming the index if `state` numbers a parameter that does not
    exist.
    """
    params = numbered_params(state, param_groups)
    loaded = {}
    for index, value in state.items():
        param = params[index]
        if owner[param] != rank:
            continue  # another rank's shard: that rank loads it
        loaded[param] = {k: to_device(v, param.device) for k, v in value.items()}
    return loaded


def numbered_params(state: dict, param_groups: list[dict]) -> list:
    """The parameters in the global numbering; IndexError naming an index of `state` that numbers a
    parameter that does not exist."""
    params = list(chain.from_iterable(g["params"] for g in param_groups))
    for index in state:
        if not 0 <= index < len(params):
            raise IndexError(f"state_dict['state'] has an entry for parameter {index}, the "
                             f"optimizer has {len(params)} parameters")
    return params


def to_device(value: Any, device: torch.device) -> Any:
    """A loaded state entry's copy on `device`; a 0-dim tensor (Adam's "step") on the CPU, where the
    optimizers keep it unless capturable."""
    if torch.is_tensor(value) and value.dim() == 0:
        return value.detach().cpu().clone()
    return copy_to(value, device)


class WholeTensorState:
    """The checkpoint part of a ZeRO policy whose ranks each step whole tensors (optimizer.py's
    StepAfterBackward, overlap.py's StepInBackward): ZeroRedundancyOptimizer's consolidate_state_dict,
    state_dict and load_state_dict ask it what to send, how to merge and what to load."""

    def local_state_dict(self, zero) -> dict:
        """What this rank sends to the consolidating rank: its local optimizer's state dict."""
        return zero.optim.state_dict()

    def merge_state_dicts(self, zero, base: dict, gathered: list) -> dict:
        """The global state dict from every rank's local one (`base`: the wrapper's groups)."""
        return merge(base, gathered, zero._partition, zero.param_groups)

    def load_state(self, zero, state: dict) -> None:
        """Give the local optimizer the entries of the parameters this rank steps."""
        owner = partition.owners(zero._partition)
        for param, value in local_state(state, zero.param_groups, owner, zero.rank).items():
            zero.optim.state[param] = value


# -- reduce_scatter=True: state kept per piece of a parameter ------------------------------------

def per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether a state entry has one value per element of a parameter of `shape` (Adam's moments,
    SGD's momentum) rather than one for the whole tensor (Adam's step). A 0-dim parameter's moments
    look like a counter: the counter is told by torch's name for it, "step"."""
    return torch.is_tensor(value) and value.shape == shape and (len(shape) > 0 or key != "step")


def merge_pieces(base: dict, gathered: list[dict], param_groups: list[dict]) -> dict:
    """The global state dict, in a plain optimizer's format, from every rank's pieces.

    Args:
        base: the wrapper's own state dict (its "param_groups" numbered globally).
        gathered: per rank, {"pieces": [(global index, lo, hi)] in its local optimizer's order,
            "state": that optimizer's state dict's "state"}: elements [lo, hi) of the flattened
            parameter, each with its state.
        param_groups: the wrapper's groups (the global numbering).
    Per-element entries are joined in element order and shaped as the parameter; the others
    (Adam's step) are equal on every piece, as every piece was stepped the same times: the first's.
    """
    params = list(chain.from_iterable(g["params"] for g in param_groups))
    parts: dict[int, list] = {}
    for sent in gathered:
        for local_index, (index, lo, hi) in enumerate(sent["pieces"]):
            if local_index in sent["state"]:
                parts.setdefault(index, []).append((lo, hi, sent["state"][local_index]))
    for index, pieces in sorted(parts.items()):
        pieces.sort(key=lambda piece: piece[0])
        param = params[index]
        if [lo for lo, _, _ in pieces] != [0] + [hi for _, hi, _ in pieces[:-1]] or \
                pieces[-1][1] != param.numel():
            raise RuntimeError(f"parameter {index}: only some ranks hold optimizer state for its "
                               "pieces (a piece not stepped on every rank); its state cannot be "
                               "joined")
        merged = {}
        for key, first in pieces[0][2].items():
            if per_element(key, first, torch.Size([pieces[0][1] - pieces[0][0]])):
                merged[key] = torch.cat([state[key] for _, _, state in pieces]).view(param.shape)
            else:
                merged[key] = first
        base["state"][index] = merged
    return base


def split_pieces(state: dict, param_groups: list[dict], pieces: list) -> dict:
    """{piece: its state}: each of this rank's pieces (parameter, its flat piece, lo, hi) gets the
    elements [lo, hi) of its parameter's per-element entries, on the piece's device, and the
    others as they are (0-dim tensors on the CPU, as the optimizers keep them)."""
    number = {p: i for i, p in enumerate(numbered_params(state, param_groups))}
    loaded = {}
    for param, piece, lo, hi in pieces:
        entry = state.get(number[param])
        if entry is None:
            continue
        loaded[piece] = {key: copy_to(value.reshape(-1)[lo:hi], piece.device)
                         if per_element(key, value, param.shape) else to_device(value, piece.device)
                         for key, value in entry.items()}
    return loaded
