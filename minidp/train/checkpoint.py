"""Checkpoints that resume exactly: model, optimizer, scheduler, sampler position, step, every rank's RNG.

File format: a 96-byte header (magic, payload length, SHA-256 of the payload) followed by a
`torch.save` payload. Loading checks the length and the hash before unpickling, so a truncated or
corrupt file is rejected with a clear error; the payload holds only tensors and plain Python
values, so it loads with `weights_only=True`.

Rank 0 writes: to a temporary file in the same folder, fsync, then an atomic rename over `path`.
Until that rename the previous checkpoint stays whole at `path`; it is also kept as `path.prev`.
"""
from __future__ import annotations

import hashlib
import io
import os
import random

import torch
import torch.distributed as dist
from torch import nn

from ..engine.collectives import all_gather_objects, collective_device
from ..runtime.watchdog import naming_laggards
from ..validate import check_int

MAGIC = b"MINIDPCK"
HEADER_BYTES = 8 + 16 + 64 + 8  # magic, hex length, hex sha256, padding


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (or buffer); the CPU for a model with neither."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _cuda_device(device):
    """The CUDA device whose generator a checkpoint keeps: the model's, else the current one; None without CUDA.

    One device, not all visible devices by index: resumed under another CUDA_VISIBLE_DEVICES,
    index i names another GPU, and the generator that matters is the one the model draws from.
    """
    if not torch.cuda.is_available():
        return None
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


def rng_state(device: torch.device | None = None) -> dict:
    """This process's random generators, in weights_only-loadable form.

    Args:
        device: the model's device; its CUDA generator is saved (else the current CUDA device's).
            Default None.
    """
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss)
    except ImportError:
        pass
    cuda = _cuda_device(device)
    if cuda is not None:
        state["cuda"] = torch.cuda.get_rng_state(cuda)
    return state


def set_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Restore what rng_state() returned; its tensors may sit on any device (torch.load's map_location).

    Args:
        state: from rng_state().
        device: the model's device; its CUDA generator is restored (else the current CUDA device's).
            Default None.
    """
    # Generator states must be CPU ByteTensors: map_location="cuda" moved them to the GPU.
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype("uint32"), pos, has_gauss, gauss))
    cuda = _cuda_device(device)
    if "cuda" in state and cuda is not None:
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # older minidp files: every visible device, by index
            saved = saved[cuda.index] if cuda.index < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved.cpu(), cuda)


def _gather_rng_states(device: torch.device) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [rng_state(device)]
    with naming_laggards("minidp.save_checkpoint()'s gather of the RNG states"):
        return all_gather_objects(rng_state(device), device=device)  # ranks meet here


def save_checkpoint(path, model, optimizer=None, scheduler=None, sampler=None, step: int = 0,
                    epoch: int = 0, extra: dict | None = None) -> None:
    """Write a checkpoint from rank 0; every rank must call it (it gathers RNG states).

    Args:
        path: the file to write (str or PathLike). Its folder must exist.
        model: the model, wrapped (minidp.DDP or torch DDP) or not; the unwrapped state is stored.
        optimizer, scheduler: their state_dict()s are stored when given. Default None.
        sampler: a minidp.DistributedSampler; its position in the epoch is stored. Default None.
        step, epoch: counters to resume from. Default 0.
        extra: any other plain values (numbers, strings, tensors, lists, dicts). Default None.
    """
    path = _check_path(path)
    _check_save_args(model, optimizer, step, epoch)
    device = _model_device(_unwrap(model))
    payload = {
        "model": _unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "sampler": sampler.state_dict() if sampler is not None else None,
        "step": step, "epoch": epoch, "extra": extra or {},
        "rng": _gather_rng_states(device),
    }
    if _rank() == 0:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        _write_atomically(path, buffer.getvalue())
    if dist.is_available() and dist.is_initialized():
        # Under NCCL a barrier is an all-reduce on a GPU: the model's, not whichever is current.
        where = collective_device(None, device)
        ids = [where.index] if where.type == "cuda" else None
        with naming_laggards("minidp.save_checkpoint()'s closing barrier"):
            dist.barrier(device_ids=ids)  # ranks meet here: nobody goes on (or loads) before the file is complete


def load_checkpoint(path, model, optimizer=None, scheduler=None, sampler=None, map_location="cpu") -> dict:
    """Restore what save_checkpoint stored, including this rank's RNG state; returns the whole payload.

    Args:
        path: the checkpoint file.
        model, optimizer, scheduler, sampler: restored in place when given (optimizer etc. default None).
        map_location: torch.load's, e.g. "cuda" to load the tensors straight onto the GPU; the RNG
            states come back to the CPU, where torch keeps generator states. Default "cpu".

    Raises:
        ValueError: the file is not a minidp checkpoint, is truncated, or fails its hash.
    """
    payload = read_checkpoint(path, map_location)
    _unwrap(model).load_state_dict(payload["model"])
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("sampler", sampler)):
        if obj is not None:
            if payload[name] is None:
                raise ValueError(f"{name}: checkpoint {path!r} holds no {name} state")
            obj.load_state_dict(payload[name])
    rngs, rank = payload["rng"], _rank()
    if len(rngs) == _world_size():
        set_rng_state(rngs[rank], _model_device(_unwrap(model)))
    return payload


def read_checkpoint(path, map_location="cpu") -> dict:
    """The verified payload of a checkpoint (model, optimizer, ..., rng), restoring nothing."""
    path = _check_path(path)
    return torch.load(io.BytesIO(read_verified(path)), map_location=map_location, weights_only=True)


def read_verified(path: str) -> bytes:
    """The payload of a checkpoint file, after checking magic, length and SHA-256."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < HEADER_BYTES or data[:8] != MAGIC:
        raise ValueError(f"checkpoint {path!r} is not a minidp checkpoint or its header is cut "
                         f"({len(data)} bytes)")
    length, digest = int(data[8:24], 16), data[24:88].decode()
    body = data[HEADER_BYTES:]
    if len(body) != length:
        raise ValueError(f"checkpoint {path!r} is truncated or padded: payload is {len(body)} bytes, "
                         f"header says {length}; use the previous checkpoint ({path}.prev)")
    if hashlib.sha256(body).hexdigest() != digest:
        raise ValueError(f"checkpoint {path!r} is corrupt: SHA-256 mismatch; use the previous "
                         f"checkpoint ({path}.prev)")
    return body


def _write_atomically(path: str, body: bytes) -> None:
    header = MAGIC + f"{len(body):016x}".encode() + hashlib.sha256(body).hexdigest().encode() + b"\n" * 8
    tmp, prev_tmp = f"{path}.tmp{os.getpid()}", f"{path}.prevtmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header + body)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):  # keep the previous one; `path` itself is never missing or partial
            _remove(prev_tmp)
            os.link(path, prev_tmp)
            os.replace(prev_tmp, f"{path}.prev")
        os.replace(tmp, path)
    finally:  # after a failure, leave no half-written temporary behind
        _remove(tmp)
        _remove(prev_tmp)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path={path!r} must be a str or os.PathLike")
    return os.fspath(path)


def _check_save_args(model, optimizer, step, epoch) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={type(model).__name__} must be a torch.nn.Module")
    if optimizer is not None and not hasattr(optimizer, "state_dict"):
        raise TypeError(f"optimizer={type(optimizer).__name__} has no state_dict()")
    check_int("step", step, 0)
    check_int("epoch", epoch, 0)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
