"""Where each forward's inputs go: to the module's device, as torch DDP moves them with device_ids.

torch DDP with `device_ids=[i]` moves each forward's inputs to device i (`_recursive_to`); minidp does
the same with `move_inputs`. What DDP refuses about devices is refused at construction (arguments.py).
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence


def move_inputs(obj, device: torch.device):
    """Move the tensors in a forward's inputs to `device`, as torch DDP does with device_ids (`_recursive_to`).

    As in DDP: the copy is a plain, blocking `.to(device)` (never non_blocking); tensors and
    PackedSequences already there, and containers holding only such things, are returned as they
    are; namedtuples (PackedSequence too) and dict subclasses keep their type; anything else,
    dataclasses included, is passed unchanged. (DDP copies from another GPU on a side stream;
    here such a copy runs on the current stream, so it needs no extra synchronisation.)

    Args:
        obj: the positional inputs (a tuple) or keyword inputs (a dict), nested as the module likes.
        device: the module's device (device_ids[0]).
    """
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        here = obj.data.device if isinstance(obj, PackedSequence) else obj.device
        return obj if here == device else obj.to(device)
    if not isinstance(obj, (tuple, list, dict)):
        return obj
    items = list(obj.values()) if isinstance(obj, dict) else list(obj)
    moved = [move_inputs(item, device) for item in items]
    if all(m is i for m, i in zip(moved, items)):
        return obj
    if isinstance(obj, dict):
        return type(obj)(zip(obj.keys(), moved))
    if hasattr(obj, "_fields") and hasattr(obj, "_asdict"):  # a namedtuple
        return type(obj)(*moved)
    return tuple(moved) if isinstance(obj, tuple) else moved  # DDP rebuilds plain tuples and lists
