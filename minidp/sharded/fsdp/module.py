"""FSDPModule: what a module becomes under fully_shard, and FSDP2's public methods on it.

fully_shard swaps the module's class for FSDP<Name>, a subclass of (FSDPModule, <Name>), made once
per class (as FSDP2 does, so that `isinstance(m, FSDPModule)` holds and code written for FSDP2,
e.g. a training loop calling set_requires_gradient_sync, finds its methods). Each method finds the
module's ModuleState (state.py) and sets what it names on its unit (unit.py) or its root.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch import nn

from minidp.engine.timeline import Timeline

from .collectives import ReducesInFlight
from .state import state_of

_fsdp_classes: dict[type, type] = {}  # <Name> -> FSDP<Name>, made once (FSDP2's cls_to_fsdp_cls)


def swap_class(module: nn.Module) -> None:
    """Make `module` an FSDP<Name>: FSDPModule first in its method resolution order."""
    cls = module.__class__
    if cls not in _fsdp_classes:
        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                  {"__deepcopy__": _refuse_deepcopy})
    module.__class__ = _fsdp_classes[cls]


def _refuse_deepcopy(*args, **kwargs):
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")


class UnshardHandle:
    """What unshard(async_op=True) returns: wait() finishes the gathers it started."""

    def __init__(self, units: list):
        self._units = units

    def wait(self) -> None:
        for unit in self._units:
            unit.wait_for_unshard()
        self._units = []


class FSDPModule:
    """The methods fully_shard gives a module (FSDP2's FSDPModule, the same names and arguments)."""

    def __new__(cls, *args, **kwargs):
        """Construct the original class (e.g. nn.Sequential slicing an FSDPSequential)."""
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _units(self, recurse: bool) -> list:
        modules = self.modules() if recurse else [self]
        units = [state_of(m).unit for m in modules if isinstance(m, FSDPModule)]
        return [u for i, u in enumerate(units) if u is not None and u not in units[:i]]

    def reshard(self) -> None:
        """Free this module's gathered parameters and put the shards back (not recursive)."""
        for unit in self._units(recurse=False):
            unit.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's parameters (not recursive; in param_dtype if set). async_op=True:
        start the gather and return a handle whose wait() finishes it (or the pre-forward does)."""
        units = self._units(recurse=False)
        for unit in units:
            unit.reset()  # parameters replaced since fully_shard (FSDP2's lazy_init here)
            unit.unshard(async_op=True)  # ranks meet here (started)
        handle = UnshardHandle(units)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, on the root: finish the collectives in
        flight, discard the failed iteration's gradients, reshard, so the next step runs."""
        state = state_of(self)
        if state.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if state.root is not None:
            state.root.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward is not the step's last (micro-batches): keep the forward
        order for the next backward's prefetch."""
        state = state_of(self)
        state.is_last_backward = is_last_backward  # the root's, from its first forward on
        if state.root is not None:
            state.root.is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """False: backward keeps the full gradients, no reduce-scatter and no all-reduce (gradient
        accumulation); the next backward with True reduces the sum."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync
            if unit.reduce_options.replicas is not None:
                unit.reduce_options.replicas.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP, False: reduce-scatter within the replica every backward but all-reduce across
        replicas only at the next backward with True (gradient accumulation, one all-reduce)."""
        for unit in self._units(recurse):
            if unit.reduce_options.replicas is not None:
                unit.reduce_options.replicas.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change reshard_after_forward at runtime (for this module and, by default, below)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                state = state_of(module)
                state.auto_reshard = False
                if state.unit is not None:
                    state.unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """False: keep the gathered parameters after backward (no gather before next forward)."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """After this module's gather in forward, start the gathers of `modules` (run next)."""
        state_of(self).forward_prefetch = _units_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """After this module's gather in backward, start the gathers of `modules` instead of the
        default (the module whose forward ran before this one's)."""
        state_of(self).backward_prefetch = _units_of(modules)

    def set_custom_all_gather(self, comm) -> None:
        """Gather with `comm`, a torch.distributed.fsdp.AllGather (its allocate() and call)."""
        for unit in self._units(recurse=False):
            unit.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """Reduce-scatter with `comm`, a torch.distributed.fsdp.ReduceScatter."""
        for unit in self._units(recurse=False):
            unit.reduce_options.reduce_scatter = comm

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call hook(reduced) on each backward's reduced gradients of this module: after the
        reduce-scatter (FSDP), after the all-reduce across replicas (HSDP), before the division.
        stream: a CUDA stream to run it in (not with HSDP; no streams on the CPU)."""
        for unit in self._units(recurse=False):
            if stream is not None and unit.mesh.is_hsdp:
                raise ValueError("stream cannot be set when using native HSDP")
            unit.reduce_options.hook = hook

    def set_post_optim_event(self, event) -> None:
        """The root's next forward waits for `event` (recorded after the optimizer step) before
        its gathers; on the CPU, one stream: nothing to wait for, the event is dropped there."""
        root = state_of(self).root
        if root is not None:
            root.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (FSDP2): set_gradient_divide_factor."""
        warnings.warn("Use `set_gradient_divide_factor` instead", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the gradients' sum by `factor` instead of averaging over the ranks."""
        for unit in self._units(recurse=False):
            unit.reduce_options.divide_factor = factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with ReduceOp.SUM only, dividing before or after the collective instead."""
        for unit in self._units(recurse=False):
            unit.reduce_options.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """True: a parameter without a gradient this backward joins the reduce-scatter with zeros
        (ranks that used different parameters still issue the same collective)."""
        for unit in self._units(recurse):
            unit.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many reduce-scatters may be in flight (default 1): more overlap, more memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        modules = self.modules() if recurse else [self]
        for module in modules:
            if isinstance(module, FSDPModule):
                state_of(module).max_reduces_in_flight = max_input_buffers
                if state_of(module).root is not None:  # after the first forward: the root's cap
                    root = state_of(module).root
                    root.reduces.max_in_flight = max(s.max_reduces_in_flight for s in root.states)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """True: the reduce-scatter runs on a process group of its own over the shard ranks, so it
        can overlap the next all-gather (ranks meet here: a new group)."""
        groups: dict = {}
        for unit in self._units(recurse):
            if not enable:
                unit.mesh.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(unit.mesh.shard_group))
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            unit.mesh.reduce_scatter_group = groups[ranks]

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's backward needs none of its parameters (e.g. an embedding's):
        no gather before it."""
        for unit in self._units(recurse=False):
            unit.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Take the collectives' buffers from the process group's allocator. gloo has none, so on
        the CPU the buffers come from torch.empty either way (as in FSDP2); refused with a custom
        comm set, as FSDP2."""
        for unit in self._units(recurse=False):
            if unit.all_gather_comm is not None or unit.reduce_options.reduce_scatter is not None:
                raise AssertionError("cannot call set_allocate_memory_from_process_group() when "
                                     "all gather or reduce scatter comm is custom")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """NCCL symmetric-memory buffers for the gathers: a speed option of CUDA's. minidp takes
        its buffers from torch.empty on CUDA all the same; on another device the next gather raises
        FSDP2's RuntimeError (there is no symmetric-memory pool for it)."""
        for unit in self._units(recurse=False):
            if unit.all_gather_comm is not None:
                raise AssertionError("cannot call set_symm_mem() when all gather comm is custom: "
                                     f"{type(unit.all_gather_comm).__name__}")
            unit.symmetric_memory = True

    def enable_timeline(self) -> Timeline:
        """From now on, record each unit's all-gathers and reduce-scatters below this module (call
        it on the root) in a minidp Timeline: spans from the collective's start to its completion,
        in the lanes "fully_shard all-gather", "fully_shard reduce-scatter" and (HSDP)
        "fully_shard all-reduce", named by the unit's module ("" for this one). Returns the
        Timeline (to_chrome_trace(), benchmarks' plots). minidp's own: FSDP2 has no such method."""
        timeline = Timeline()
        for name, module in self.named_modules():
            state = state_of(module)
            if state is not None and state.unit is not None:
                state.unit.timeline, state.unit.name = timeline, name
        return timeline

    def _apply(self, *args, **kwargs):
        """nn.Module._apply (to_empty(), to(), half(), ...) on the shards, then the unit adopts
        the new tensors."""
        self.reshard()
        out = super()._apply(*args, **kwargs)
        unit = state_of(self).unit
        if unit is not None:
            with torch.no_grad():
                unit.reset()
        return out


def _units_of(modules: list) -> list:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
    return [state_of(m).unit for m in modules if state_of(m).unit is not None]


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.<method_name>` gather and free like forward (e.g. a generate() that does not
    go through forward). A no-op on a module fully_shard did not shard (as FSDP2)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        state = state_of(self)
        args, kwargs = state.pre_forward(self, args, kwargs)
        return state.post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list) -> None:
    """Let the roots `modules` (e.g. pipeline stages, each its own fully_shard root) share one
    communication context: their reduce-scatters in flight (FSDP2's share_comm_ctx; on a GPU, its
    CUDA streams too, which minidp does not use)."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
    if not modules:
        return
    shared = ReducesInFlight()
    for module in modules:
        state = state_of(module)
        state.shared_reduces = shared
        if state.root is not None:
            state.root.reduces = shared
