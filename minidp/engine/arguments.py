"""The wrapper's constructor checks that run before any collective: arguments, device_mesh, transport.

A bad argument raises on every rank before the ranks meet (TypeError for a wrong type, ValueError for
a wrong value, torch DDP's RuntimeError where torch raises one), so no rank waits in a collective that
another rank never starts.
"""
from __future__ import annotations

import difflib
import inspect
import math

import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

from ..validate import check_bool, check_number
from .cap_list import check_cap_list
from .compat import ignored_names
from .delayed import check_delayed
from .hooks import Transport
from .mixed_precision import check_mixed_precision
from .skip_unused import check_skip

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
