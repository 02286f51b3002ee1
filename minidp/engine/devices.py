"""Where the wrapper's module and inputs live: one device per process, inputs moved there as DDP does.

torch DDP with `device_ids=[i]` moves each forward's inputs to device i (`_recursive_to`); minidp does
the same with `move_inputs`, and refuses at construction what DDP refuses (`check_devices`), plus modules
spread over several devices.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import PackedSequence


def check_devices(params: list, device_ids) -> torch.device | None:
    """The device inputs are moved to (None: not moved), refusing what DDP refuses, and multi-device modules.

    A module on several devices is refused even without device_ids: the autograd engine runs each
    device's part of backward on its own thread, and the reducer's state is not made for that.
    """
    devices = {p.device for p in params}
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"minidp.DDP's module must be on one type of device, but its parameters are on {devices}")
    if len(devices) > 1:
        raise ValueError(f"minidp.DDP needs a single-device module (one device per process), but its parameters "
                         f"are on {sorted(map(str, devices))}: its gradient hooks would run on several threads")
    if device_ids is None or (isinstance(device_ids, (list, tuple)) and len(device_ids) == 0):
        return None  # DDP treats [] as None too
    if not isinstance(device_ids, (list, tuple)):
        raise TypeError(f"device_ids={device_ids!r} must be None or a list holding one device")
    if len(device_ids) != 1:
        raise ValueError(f"device_ids={device_ids!r} must be None or a list holding one device (one per process)")
    device = next(iter(devices))
    if device.type == "cpu":
        raise ValueError(f"device_ids={device_ids!r} given for a module on the CPU: pass device_ids=None")
    target = torch.device(device.type, device_ids[0]) if isinstance(device_ids[0], int) else torch.device(device_ids[0])
    if target.index is None:  # "cuda": the current device, as DDP reads it
        target = torch.device(target.type, torch.accelerator.current_device_index())
    if target != device:
        raise ValueError(f"device_ids={device_ids!r}: the module is on {device}, not on {target}; "
                         f"move it there first (module.to({str(target)!r}))")
    return target


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


def check_sync_batchnorm(module: torch.nn.Module, device: torch.device | None) -> None:
    """torch.nn.SyncBatchNorm runs on GPUs only: refused on a CPU module at construction, as torch DDP does."""
    if device is not None and device.type == "cpu" and any(
            isinstance(layer, torch.nn.SyncBatchNorm) for layer in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules (torch.nn.SyncBatchNorm, as in "
                         "torch DDP); on the CPU, convert with minidp.convert_sync_batchnorm(model), "
                         "which runs on gloo")
