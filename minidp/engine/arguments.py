"""The wrapper's keywords: checked before any collective, then read once into what the core is handed.

First the checks (arguments, devices, device_mesh, transport); then `choose`, which turns the mode
keywords into the policies the reducer and its layout are given (a `Mode`), so no first-read file
tests a mode. Last, `move_inputs`: with device_ids, each forward's inputs go to the module's device,
as torch DDP moves them (`_recursive_to`).

A bad argument raises on every rank before the ranks meet (TypeError for a wrong type, ValueError for
a wrong value, torch DDP's RuntimeError where torch raises one), so no rank waits in a collective that
another rank never starts.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.rnn import PackedSequence

from ..validate import check_bool, check_number
from . import planning
from .bucket_kinds import (
    MixedPrecisionBucket,
    MixedPrecisionState,
    SparseBucket,
    ViewBucket,
    check_mixed_precision,
    sparse_gradient_flags,
)
from .buckets import Bucket
from .delayed import check_delayed
from .hooks import Transport
from .layout import AutoCap, check_cap_list, limits_of
from .readiness import FindUnused, SkipUnused, StaticGraph, check_skip
from .step import EveryParameter

# torch DDP's keywords that minidp implements in second-read files, with their defaults.
# torch 2.14 DDP's constructor keywords, written out: the engine reads nothing of torch's DDP
# (tests/test_ddp_keywords.py checks the list against the installed torch's signature)
TORCH_DDP_SIGNATURE = ("module", "device_ids", "output_device", "dim", "broadcast_buffers", "init_sync",
                       "process_group", "bucket_cap_mb", "find_unused_parameters", "check_reduction",
                       "gradient_as_bucket_view", "static_graph", "delay_all_reduce_named_params",
                       "param_to_hook_all_reduce", "mixed_precision", "device_mesh",
                       "skip_all_reduce_unused_params", "bucket_cap_mb_list", "batched_grad_copy",
                       "forward_sync_buffers")
TORCH_KEYWORDS = {"bucket_cap_mb_list": None, "skip_all_reduce_unused_params": False,
                  "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None,
                  "mixed_precision": None}


def group_of_mesh(device_mesh, process_group):
    """The group to average over given device_mesh (DDP's rules): a 1-D mesh's group, or process_group."""
    if device_mesh is None:
        return process_group
    from torch.distributed.device_mesh import DeviceMesh  # here: only scripts that pass a mesh need it
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh={device_mesh!r} must be a torch.distributed.DeviceMesh or None")
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments.")  # DDP's words
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, but got {device_mesh}.")
    return device_mesh.get_group(mesh_dim=0)


def ignored_names(module: nn.Module, keywords: dict) -> set:
    """The names set by _set_params_and_buffers_to_ignore_for_model: neither broadcast nor averaged by
    the reducer; with them, as in torch DDP, delay_all_reduce_named_params' (delayed.py averages those)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(
        keywords.get("delay_all_reduce_named_params") or ())


def check_arguments(module, bucket_cap_mb, process_group, flags: dict, torch_later: dict, constructor) -> dict:
    """The constructor's checks that need no process group (they raise before any collective).

    Args:
        torch_later: the keywords minidp.DDP's signature does not name (torch DDP's later ones).
        constructor: the wrapper's __init__, whose keywords an unknown one is matched against (did you mean?).
    Returns:
        torch DDP's later keywords that minidp implements (TORCH_KEYWORDS), checked, defaults filled in
        (parameters by name).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__} must be a torch.nn.Module")
    if any(is_lazy(p) for p in module.parameters()):  # nn.LazyLinear & co. before their first forward
        raise RuntimeError("Modules with uninitialized parameters can't be used with `DistributedDataParallel`. "
                           "Run a dummy forward pass to correctly initialize the modules")  # torch DDP's words
    for name, flag in flags.items():
        if not (name in ("debug", "forward_sync_buffers", "broadcast_buffers") and flag is None):  # None: a default
            check_bool(name, flag)
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group={process_group!r} must be a torch.distributed.ProcessGroup or None")
    if isinstance(bucket_cap_mb, str) and bucket_cap_mb != "auto":
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number of MiB >= 0, None or \"auto\"")
    if bucket_cap_mb is not None and bucket_cap_mb != "auto":  # MiB; None: DDP's default (25, first bucket 1)
        check_number("bucket_cap_mb", bucket_cap_mb, low=0)  # 0: one bucket per tensor, as in torch DDP
        if not math.isfinite(bucket_cap_mb):
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be finite (a number of MiB)")
    keywords = dict(TORCH_KEYWORDS)
    for name, value in torch_later.items():
        check_keyword(name, constructor)
        if name in keywords:
            keywords[name] = value
        elif value not in (None, False):
            raise ValueError(f"minidp.DDP does not support {name}={value!r}")
    keywords["bucket_cap_mb_list"] = check_cap_list(keywords["bucket_cap_mb_list"], bucket_cap_mb)
    skip = keywords["skip_all_reduce_unused_params"]
    keywords["skip_all_reduce_unused_params"] = check_skip(skip, flags["static_graph"])
    delayed = keywords["delay_all_reduce_named_params"], keywords["param_to_hook_all_reduce"]
    names, hook_name = check_delayed(module, *delayed, ignored_names(module, {}))  # names, not tensors
    keywords["delay_all_reduce_named_params"], keywords["param_to_hook_all_reduce"] = names, hook_name
    keywords["mixed_precision"] = check_mixed_precision(keywords["mixed_precision"], flags)
    return keywords


def check_keyword(name: str, constructor) -> None:
    """A keyword minidp.DDP lacks: TypeError unless torch DDP has it (a misspelt keyword fails as in torch).

    torch DDP's own keywords that minidp.DDP's signature does not name pass here: those in TORCH_KEYWORDS
    are implemented in second-read files; any other the caller refuses by name unless left at its
    default, so a script that spells out torch's defaults still runs. The hint names the closest
    keyword of `constructor` (the wrapper's __init__, passed in: this module does not import ddp.py,
    which imports it).
    """
    if name in TORCH_DDP_SIGNATURE:
        return
    accepted = [k for k, p in inspect.signature(constructor).parameters.items()
                if k != "self" and p.kind != p.VAR_KEYWORD]
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TypeError(f"DistributedDataParallel.__init__() got an unexpected keyword argument {name!r}{hint}")


def check_transport(transport, module: nn.Module, process_group):
    """The transport for the default all-reduce (None: process_group): a minidp.comm one, for this module's ranks."""
    if transport is None:
        return None
    if not isinstance(transport, Transport):  # the engine's protocol: world_size, check_device, all_reduce
        raise TypeError(f"transport={transport!r} must be a minidp.comm transport (comm.TorchDist(), "
                        "comm.CupyNccl()) or None")
    if transport.world_size != dist.get_world_size(process_group):
        raise ValueError(f"transport={transport!r} spans {transport.world_size} ranks, but process_group has "
                         f"{dist.get_world_size(process_group)}: it must carry the same ranks")
    device = next(module.parameters()).device
    transport.check_device(device)  # ValueError naming the transport and the device
    return transport


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


def check_sync_batchnorm(module: torch.nn.Module, device: torch.device | None) -> None:
    """torch.nn.SyncBatchNorm runs on GPUs only: refused on a CPU module at construction, as torch DDP does."""
    if device is not None and device.type == "cpu" and any(
            isinstance(layer, torch.nn.SyncBatchNorm) for layer in module.modules()):
        raise ValueError("SyncBatchNorm layers only work with GPU modules (torch.nn.SyncBatchNorm, as in "
                         "torch DDP); on the CPU, convert with minidp.convert_sync_batchnorm(model), "
                         "which runs on gloo")


# The wrapper's mode keywords, read in one place: what the core is given instead of `if mode` branches.
#
# What it changes in the core: nothing; it picks. The reducer asks a readiness policy (step.py's
# EveryParameter, or readiness.py's); the layout makes its buckets with a factory (buckets.py, or
# bucket_kinds.py, which also says which gradients are sparse), cuts them by a list of limits
# (planning.py, or layout.py's bucket_cap_mb_list limits) and lets a tuner change its cap (layout.py's
# AutoCap). `choose` picks them from the keywords, once per reducer (again when a pickled wrapper is
# loaded), so no file of the first read imports a mode's file.

class Mode(NamedTuple):
    """What `choose` gives the reducer (readiness) and its layout (the rest).

    readiness: the policy the reducer asks whether a gradient is final (step.py, readiness.py).
    sparse: by parameter, whether its gradient is sparse: a bucket of its own and kind.
    new_bucket: (index, param_indices, params, sparse) -> a bucket of the mode's kind.
    needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuilt once, in ready order.
    cap: the cap (MiB) the layout starts with: bucket_cap_mb (None: DDP's default), or under "auto"
        the tuner's first candidate; with bucket_cap_mb_list, the list's largest (as torch's).
    limits: (cap, first_iteration, needs_rebuild) -> the byte limits of a plan: planning's
        bucket_limits, or bucket_cap_mb_list's (layout.limits_of).
    tuner: bucket_cap_mb="auto"'s AutoCap, which changes the layout's cap in the first iterations.
    compile_cap: the cap torch.compile's graph is cut at (graph_split.py): bucket_cap_mb, or DDP's
        default (None) under "auto", whose cap is not chosen yet when the module is compiled.
    """

    readiness: object
    sparse: list[bool]
    new_bucket: Callable
    needs_rebuild: bool
    cap: float | None
    limits: Callable
    tuner: AutoCap | None
    compile_cap: float | None


def choose(ddp, params: list, names: list[str]) -> Mode:
    """The mode of the wrapper `ddp`'s keywords (static_graph wins over find_unused_parameters).

    Args:
        ddp: the minidp.DistributedDataParallel; its bucket_cap_mb, find_unused_parameters,
            static_graph and gradient_as_bucket_view are read (its keywords, validated already),
            and its module, process_group and transport (which gradients are sparse, and whether
            they can be reduced there: bucket_kinds.py).
        params, names: the reducer's parameters and their names.
    """
    sparse = sparse_gradient_flags(ddp.module, params, names, ddp.process_group, ddp.transport)
    bucket_cap_mb = ddp.bucket_cap_mb
    static_graph = ddp.static_graph
    find_unused_parameters = ddp.find_unused_parameters
    if static_graph:
        readiness = StaticGraph(names)
    elif find_unused_parameters:  # skip_all_reduce_unused_params: less some all-reduces
        skip = ddp.torch_keywords["skip_all_reduce_unused_params"]
        readiness = (SkipUnused if skip else FindUnused)(names)
    else:
        readiness = EveryParameter(names)
    dense = ViewBucket if ddp.gradient_as_bucket_view else Bucket
    if ddp.mixed_precision is not None:  # buckets in reduce_dtype
        dense = functools.partial(MixedPrecisionBucket, state=MixedPrecisionState(ddp, sparse))
    tuner = AutoCap() if bucket_cap_mb == "auto" else None  # the one place that reads "auto"
    caps = ddp.torch_keywords["bucket_cap_mb_list"]  # None, or a non-empty list
    limits = planning.bucket_limits if caps is None else functools.partial(limits_of, caps)
    bucket_cap_mb = bucket_cap_mb if caps is None else max(caps)  # torch ignores it then
    return Mode(readiness=readiness,
                sparse=sparse,
                new_bucket=functools.partial(new_bucket, dense=dense),
                needs_rebuild=static_graph or not find_unused_parameters,
                cap=bucket_cap_mb if tuner is None else tuner.cap,
                limits=limits,
                tuner=tuner,
                compile_cap=bucket_cap_mb if tuner is None else None)


def new_bucket(index: int, param_indices: list[int], params: list, sparse: bool, dense=Bucket):
    """A bucket of the mode's kind: a sparse gradient's own, else `dense`."""
    kind = SparseBucket if sparse else dense
    return kind(index, param_indices, params)


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
