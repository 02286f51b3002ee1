"""minidp.fully_shard: FSDP2's `fully_shard` written from scratch (ZeRO-3, or ZeRO-2-like, or HSDP).

    mesh = init_device_mesh("cpu", (world_size,))   # or leave mesh=None: the world
    for block in model.blocks:
        minidp.fully_shard(block, mesh=mesh)
    minidp.fully_shard(model, mesh=mesh)             # the root: the parameters left over
    opt = torch.optim.AdamW(model.parameters())      # built after: it steps the DTensor shards

After it, the module's parameters are DTensors sharded on dim 0 (FSDP2's layout, padding included)
and the module is an FSDP<Name>, a subclass of minidp.FSDPModule with FSDP2's methods (module.py).
A 2-D mesh (replicate, shard) is HSDP: shards within a replica, an all-reduce across replicas.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from .mesh import ShardMesh, check_mesh, post_forward_mesh
from .module import swap_class
from .state import STATE_ATTRIBUTE, ModuleState, state_of
from .unit import Unit

NO_CASTS = MixedPrecisionPolicy()  # the default policy: compute, gather and reduce in fp32
NO_OFFLOAD = OffloadPolicy()


def fully_shard(module: nn.Module | list, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None, shard_placement_fn=None,
                mp_policy: MixedPrecisionPolicy = NO_CASTS,
                offload_policy: OffloadPolicy = NO_OFFLOAD,
                ignored_params: set | None = None, dp_mesh_dims=None):
    """Shard `module`'s parameters (less those a fully_shard below it shards); returns `module`.

    Args:
        module: a module with a forward (not a bare ModuleList/ModuleDict, as FSDP2), or a list of
            them: one unit for all (e.g. two modules that share a weight, or [norm, head] for a
            chunked loss).
        mesh: a 1-D DeviceMesh, or a 2-D one with mesh_dim_names (replicate, shard): HSDP
            (default None: every rank of the default process group, on the accelerator if there
            is one, else on the CPU).
        reshard_after_forward: free the gathered parameters after forward and gather them again in
            backward (True); keep them until the end of backward (False); None (default): True
            except for the root, as FSDP2; an int k, a divisor of the shard group's size: keep a
            shard over k ranks after forward, so backward's gather runs within k ranks.
        shard_placement_fn: parameter -> Shard(dim) or None (dim 0), per parameter (default None:
            all on dim 0). A dim other than 0 must divide evenly over the shard group, as FSDP2.
        mp_policy: torch's MixedPrecisionPolicy (default: no casts). param_dtype: the gathered
            weights' dtype (forward and backward compute in it; the shards and the optimizer stay
            in the parameters' dtype); reduce_dtype: the gradients' in the reduce-scatter;
            output_dtype: the forward's outputs are cast to it; cast_forward_inputs: the floating
            inputs are cast to param_dtype.
        offload_policy: torch's OffloadPolicy (default: none) or CPUOffloadPolicy: the shards, their
            gradients and so the optimizer step stay on the CPU; copied to the device to gather.
        ignored_params: parameters left alone (default None): not sharded, not moved, their
            gradients not reduced (as FSDP2: the caller syncs them if it wants to).
        dp_mesh_dims: FSDP2's SPMD-mesh form (parameters already DTensors); not built here.
    """
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and \
            type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: "
                         f"{module}")
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for one in modules:
        _check(one, mesh, mp_policy, offload_policy, dp_mesh_dims)
    mesh = mesh if mesh is not None else _default_mesh()
    check_mesh(mesh)
    shard_mesh = ShardMesh(mesh)
    post_forward = post_forward_mesh(True if reshard_after_forward is None
                                     else reshard_after_forward, shard_mesh)
    device = torch.device("cpu") if mesh.device_type == "cpu" else \
        torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    managed = _managed_modules(modules)
    params = _managed_params(managed, set(ignored_params or ()))
    for m in managed:  # buffers go where the parameters go (FSDP2 moves them too)
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[name] = buf.to(device)
    dims = [_shard_dim(shard_placement_fn, p) for p, _ in params]
    if any(dims) and post_forward not in (None, shard_mesh):
        raise NotImplementedError("minidp.fully_shard: an int reshard_after_forward with a "
                                  "shard_placement_fn placing a parameter on a dim other than 0 "
                                  "is not built")
    if any(isinstance(p, DTensor) for p, _ in params) and post_forward not in (None, shard_mesh):
        # FSDP2's refusal, word for word (it raises at the first forward's end; here, before any work)
        raise NotImplementedError("Resharding to smaller mesh is not supported for DTensor parameters yet")
    offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
    unit = Unit(params, shard_mesh, device, post_forward, mp_policy, dims, offload) \
        if params else None
    state = ModuleState(modules, unit, reshard_after_forward is None, mp_policy)
    for one in modules:
        one.__dict__[STATE_ATTRIBUTE] = state
        swap_class(one)
    return module


def _check(module, mesh, mp_policy, offload_policy, dp_mesh_dims) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"minidp.fully_shard takes an nn.Module or a list of them; got "
                        f"{type(module).__name__}")
    if state_of(module) is not None:
        raise AssertionError("Each distinct composable distributed API can only be applied to a "
                             "module once. fully_shard has already been applied to the following "
                             f"module:\n{module}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r} must be a torch.distributed.device_mesh.DeviceMesh or None")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy={mp_policy!r} must be a torch.distributed.fsdp."
                        "MixedPrecisionPolicy")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"offload_policy={offload_policy!r} must be a torch.distributed.fsdp."
                        "OffloadPolicy or CPUOffloadPolicy")
    if dp_mesh_dims is not None:
        raise NotImplementedError(f"dp_mesh_dims={dp_mesh_dims!r}: FSDP2's SPMD-mesh form "
                                  "(parameters already DTensors on a full mesh) is not built in "
                                  "minidp.fully_shard; pass a 1-D or 2-D data-parallel mesh")


def _shard_dim(shard_placement_fn, param: nn.Parameter) -> int:
    """The dim shard_placement_fn places `param` on: None -> 0, Shard(dim) -> dim."""
    if shard_placement_fn is None:
        return 0
    placement = shard_placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"shard_placement_fn returned {placement!r}: minidp.fully_shard "
                                  "takes a Shard(dim) or None (a per-parameter mesh is not built)")
    return placement.dim


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("minidp.fully_shard needs a process group: call minidp.init() (or "
                           "torch.distributed.init_process_group()) first, or pass mesh=")
    # current_accelerator() can name CUDA where no GPU is usable (seen: torch 2.14 on a CPU machine)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
        else None
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _managed_modules(roots: tuple) -> list:
    """The modules whose parameters this call shards: the roots' subtrees minus fully_shard'ed
    subtrees, each module after its children (FSDP2's order, which is the flat buffers' order)."""
    modules, seen = [], set()

    def visit(module):
        if module not in roots and state_of(module) is not None:
            return
        seen.add(module)
        for child in module.children():
            if child not in seen:
                visit(child)
        modules.append(module)

    for root in roots:
        if root not in seen:
            visit(root)
    return modules


def _managed_params(modules: list, ignored: set) -> list:
    """[(parameter, [(module, name), ...]), ...]: each parameter once, with every name it has."""
    places: dict = {}
    for module in modules:
        for name, param in module._parameters.items():
            if param is None or param in ignored:
                continue
            if param.dim() == 0:
                raise ValueError("fully_shard doesn't support scalar parameters. "
                                 f"Change {name} to a 1D tensor with numel equal to 1.")
            places.setdefault(param, []).append((module, name))
    return list(places.items())
