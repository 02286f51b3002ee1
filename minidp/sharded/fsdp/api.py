"""minidp.fully_shard: FSDP2's `fully_shard` written from scratch (ZeRO-3, or ZeRO-2-like).

    mesh = init_device_mesh("cpu", (world_size,))   # or leave mesh=None: the world
    for block in model.blocks:
        minidp.fully_shard(block, mesh=mesh)
    minidp.fully_shard(model, mesh=mesh)             # the root: the parameters left over
    opt = torch.optim.AdamW(model.parameters())      # built after: it steps the DTensor shards

After it, the module's parameters are DTensors sharded on dim 0 (FSDP2's layout, padding included),
and the module has FSDP2's methods unshard(), reshard(), set_requires_gradient_sync(),
set_reshard_after_forward(), set_reshard_after_backward(), set_modules_to_forward_prefetch() and
set_modules_to_backward_prefetch(), bound to the instance (minidp builds no class at runtime;
FSDP2 swaps the module's class for an FSDP subclass).
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from minidp.engine.timeline import Timeline
from minidp.validate import check_bool

from .state import STATE_ATTRIBUTE, ModuleState, state_of
from .unit import Unit

NO_CASTS = MixedPrecisionPolicy()  # the default policy: compute, gather and reduce in fp32


def fully_shard(module: nn.Module | list, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | None = True,
                mp_policy: MixedPrecisionPolicy = NO_CASTS,
                ignored_params: set | None = None) -> nn.Module:
    """Shard `module`'s parameters (less those a fully_shard below it shards); returns `module`.

    Args:
        module: a module with a forward (not a bare ModuleList/ModuleDict, as FSDP2), or a list of
            them: one unit for all (e.g. two modules that share a weight).
        mesh: a 1-D DeviceMesh (default None: every rank of the default process group, on the
            accelerator if there is one, else on the CPU).
        reshard_after_forward: free the gathered parameters after forward and gather them again in
            backward (default True; False keeps them until the end of backward; None: True except
            for the root, as FSDP2).
        mp_policy: torch's MixedPrecisionPolicy (default: no casts). param_dtype: the gathered
            weights' dtype (forward and backward compute in it; the shards and the optimizer stay
            in the parameters' dtype); reduce_dtype: the gradients' in the reduce-scatter;
            output_dtype: the forward's outputs are cast to it; cast_forward_inputs: the floating
            inputs are cast to param_dtype.
        ignored_params: parameters left alone (default None): not sharded, not moved, their
            gradients not reduced (as FSDP2: the caller syncs them if it wants to).
    """
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for one in modules:
        _check(one, mesh, reshard_after_forward, mp_policy)
    mesh = mesh if mesh is not None else _default_mesh()
    if mesh.ndim != 1:
        raise NotImplementedError(f"minidp.fully_shard takes a 1-D mesh; got mesh.ndim={mesh.ndim} "
                                  "(FSDP2's HSDP, a 2-D mesh, is not built in minidp)")
    device = torch.device("cpu") if mesh.device_type == "cpu" else \
        torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
    managed = _managed_modules(modules)
    params = _managed_params(managed, set(ignored_params or ()))
    for m in managed:  # buffers go where the parameters go (FSDP2 moves them too)
        for name, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[name] = buf.to(device)
    unit = Unit(params, mesh, device, reshard_after_forward is not False, mp_policy) \
        if params else None
    state = ModuleState(modules, unit, reshard_after_forward is None, mp_policy)
    for one in modules:
        one.__dict__[STATE_ATTRIBUTE] = state
        for name, method in _METHODS.items():
            setattr(one, name, types.MethodType(method, one))
    return module


def _check(module, mesh, reshard_after_forward, mp_policy) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"minidp.fully_shard takes an nn.Module or a list of them; got "
                        f"{type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and \
            type(module).forward is nn.Module.forward:
        raise ValueError(f"fully_shard does not support containers that do not implement forward: "
                         f"{module}")
    if state_of(module) is not None:
        raise AssertionError("Each distinct composable distributed API can only be applied to a "
                             "module once. fully_shard has already been applied to the following "
                             f"module:\n{module}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r} must be a torch.distributed.device_mesh.DeviceMesh or None")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(f"reshard_after_forward={reshard_after_forward}: an int (FSDP2's "
                                  "resharding to a smaller world after forward) is not built in "
                                  "minidp.fully_shard; pass True, False or None")
    if reshard_after_forward is not None:
        check_bool("reshard_after_forward", reshard_after_forward)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy={mp_policy!r} must be a torch.distributed.fsdp."
                        "MixedPrecisionPolicy")


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


def _states(module: nn.Module, recurse: bool) -> list:
    modules = module.modules() if recurse else [module]
    states = [s for s in map(state_of, modules) if s is not None]
    return [s for i, s in enumerate(states) if s not in states[:i]]  # a list's state: once


def unshard(self: nn.Module, async_op: bool = False):
    """Gather this module's parameters now (not recursive). The gather is synchronous: with
    async_op=True the returned handle's wait() has nothing left to wait for."""
    unit = state_of(self).unit
    if unit is not None:
        unit.unshard()  # ranks meet here
    return _Done() if async_op else None


def reshard(self: nn.Module) -> None:
    """Free this module's gathered parameters and put the shards back (not recursive)."""
    unit = state_of(self).unit
    if unit is not None:
        unit.reshard()


def set_requires_gradient_sync(self: nn.Module, requires_gradient_sync: bool, *,
                               recurse: bool = True) -> None:
    """False: backward keeps the full gradients on the gathered parameters, with no reduce-scatter
    (gradient accumulation); the next backward with True reduces the sum."""
    for state in _states(self, recurse):
        if state.unit is not None:
            state.unit.requires_gradient_sync = requires_gradient_sync


def set_reshard_after_forward(self: nn.Module, reshard_after_forward: bool,
                              recurse: bool = True) -> None:
    """Change reshard_after_forward at runtime (for this module and, by default, those below)."""
    if not isinstance(reshard_after_forward, bool):
        raise ValueError("reshard_after_forward should be a bool, got "
                         f"{type(reshard_after_forward)}")
    for state in _states(self, recurse):
        state.auto_reshard = False
        if state.unit is not None:
            state.unit.reshard_after_forward = reshard_after_forward


def set_reshard_after_backward(self: nn.Module, reshard_after_backward: bool, *,
                               recurse: bool = True) -> None:
    """False: keep the gathered parameters after backward (no gather before the next forward)."""
    for state in _states(self, recurse):
        if state.unit is not None:
            state.unit.reshard_after_backward = reshard_after_backward


def set_modules_to_forward_prefetch(self: nn.Module, modules: list) -> None:
    """After this module's gather in forward, start the gathers of `modules` (fully_shard'ed, run
    next), so that they overlap this module's forward (FSDP2's explicit forward prefetch)."""
    state_of(self).forward_prefetch = _units_of(modules)


def set_modules_to_backward_prefetch(self: nn.Module, modules: list) -> None:
    """After this module's gather in backward, start the gathers of `modules` instead of the
    default (the module whose forward ran before this one's)."""
    state_of(self).backward_prefetch = _units_of(modules)


def _units_of(modules: list) -> list:
    states = [state_of(m) for m in modules]
    for module, state in zip(modules, states):
        if state is None:
            raise ValueError(f"Expects a module that minidp.fully_shard sharded but got {module}")
    return [s.unit for s in states if s.unit is not None]


def enable_timeline(self: nn.Module) -> Timeline:
    """From now on, record each unit's all-gathers and reduce-scatters below this module (call it
    on the root) in a minidp Timeline: spans from the collective's start to its completion, in the
    lanes "fully_shard all-gather" and "fully_shard reduce-scatter", named by the unit's module
    ("" for this one). Returns the Timeline (to_chrome_trace(), benchmarks' plots). minidp's own:
    FSDP2 has no such method."""
    timeline = Timeline()
    for name, module in self.named_modules():
        state = state_of(module)
        if state is not None and state.unit is not None:
            state.unit.timeline, state.unit.name = timeline, name
    return timeline


def _apply(self: nn.Module, *args, **kwargs):
    """nn.Module._apply (to_empty(), to(), half(), ...), then the unit adopts the new tensors."""
    out = type(self)._apply(self, *args, **kwargs)  # the children's own _apply run inside
    if state_of(self).unit is not None:
        state_of(self).unit.reset()
    return out


class _Done:
    """The handle unshard(async_op=True) returns: the gather has already happened."""

    def wait(self) -> None:
        pass


_METHODS = {f.__name__: f for f in (unshard, reshard, set_requires_gradient_sync,
                                    set_reshard_after_forward, set_reshard_after_backward,
                                    set_modules_to_forward_prefetch,
                                    set_modules_to_backward_prefetch, enable_timeline, _apply)}
