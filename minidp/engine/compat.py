"""The torch-compat surface: what minidp.DDP has only because torch DDP has it.

Scripts and libraries written for torch DDP read its attributes, call its legacy helpers and private
APIs, pickle it, and mark parameters to ignore. None of this is needed to average gradients; it is
here, so that ddp.py shows the engine alone: the wrapper's constructor calls the functions
(`ignored_names`, `buffer_sync`, `set_torch_attributes`), its forward `buffers_to_sync`, and the
methods torch DDP has are those of `TorchCompat`, a base class of minidp.DistributedDataParallel.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from .delayed import DelayedAllReduce
from .devices import move_inputs
from .hook_checks import check_comm_hook
from .logging_data import RuntimeSamples, log_and_raise, logging_data, set_sample_rate
from .static_graph import set_static_graph


def ignored_names(module: nn.Module, keywords: dict) -> set:
    """The names set by _set_params_and_buffers_to_ignore_for_model: neither broadcast nor averaged by
    the reducer; with them, as in torch DDP, delay_all_reduce_named_params' (delayed.py averages those)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(
        keywords.get("delay_all_reduce_named_params") or ())


def buffer_sync(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
    """(sync buffers at construction, in every forward): torch >= 2.14 splits broadcast_buffers
    (both; None means True) into construction and forward_sync_buffers (forward only, when given)."""
    broadcast_buffers = True if broadcast_buffers is None else broadcast_buffers
    if forward_sync_buffers is None:
        return broadcast_buffers, broadcast_buffers
    return True, forward_sync_buffers


def set_torch_attributes(ddp, output_device, dim, batched_grad_copy, device_mesh) -> None:
    """torch DDP's other public attributes on the wrapper `ddp`, with its values, for scripts that read them."""
    named_buffers = {n: b for n, b in ddp.module.named_buffers() if n not in ddp.parameters_to_ignore}
    ddp.device_ids = None if ddp.input_device is None else [ddp.input_device.index]  # as DDP's
    ddp.device_type = ddp.device.type if ddp.device is not None else None
    ddp.output_device, ddp.dim, ddp.device_mesh = output_device, dim, device_mesh
    ddp.forward_sync_buffers = ddp.broadcast_buffers  # torch >= 2.14's name for it
    ddp.batched_grad_copy = batched_grad_copy  # accepted: small gradients are copied in batches anyway
    ddp.divide_by_initial_world_size = True  # set by join_hook(), under join()
    ddp.named_module_buffers, ddp.modules_buffers = named_buffers, list(named_buffers.values())
    ddp._ignored_buffers = len(named_buffers) != sum(1 for _ in ddp.module.buffers())
    ddp.mixed_precision, ddp.is_multi_device_module = ddp.torch_keywords["mixed_precision"], False
    ddp.skip_all_reduce_unused_params = ddp.torch_keywords["skip_all_reduce_unused_params"]
    caps = ddp.torch_keywords["bucket_cap_mb_list"]  # None or MiB (cap_list.py)
    ddp.bucket_bytes_cap_default = ddp.bucket_cap_mb is None and caps is None
    ddp.bucket_bytes_cap_list = [] if caps is None else [int(mb * 1024 * 1024) for mb in caps]
    ddp.use_side_stream_for_tensor_copies = False  # inputs are copied on the current stream (move_inputs)
    names = ddp.torch_keywords["delay_all_reduce_named_params"]
    hook_name = ddp.torch_keywords["param_to_hook_all_reduce"]
    ddp._delayed = None if names is None else DelayedAllReduce(ddp, names, hook_name)  # ranks meet there
    ddp._delay_all_reduce_params = [] if names is None else ddp._delayed.params  # torch DDP's names
    ddp._delay_grad_buffer = None if names is None else ddp._delayed.buffer
    ddp._delay_grad_views = [] if names is None else ddp._delayed.views
    ddp._logging = RuntimeSamples(ddp)  # what _get_ddp_logging_data() reports of past forwards
    ddp._builtin_hook_name = None  # set by _register_builtin_comm_hook, as torch's logger names it


def buffers_to_sync(ddp) -> list[torch.Tensor]:
    """The module's buffers but those set to be ignored (_set_params_and_buffers_to_ignore_for_model)."""
    if not ddp._ignored_buffers:
        return list(ddp.module.buffers())
    return [b for n, b in ddp.module.named_buffers() if n not in ddp.parameters_to_ignore]


def refuse_as_reducer(ddp, message: str):
    """Raise RuntimeError(message), logged as torch's C++ reducer logs its errors (the bare message)."""
    log_and_raise(ddp, RuntimeError, message, by_reducer=True)


class TorchCompat:
    """torch DDP's methods and properties, with its values and behaviour (a base class of the wrapper,
    whose constructor and forward call none of them)."""

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (DDP's method of that name)."""
        return self.require_forward_param_sync and self.broadcast_buffers and self.has_buffers

    @property
    def bucket_bytes_cap(self) -> int:
        """The bucket cap in bytes, as DDP's attribute (25 MiB by default; under "auto" the cap in use)."""
        cap = self.reducer.layout.cap
        return int((25 if cap is None else cap) * 1024 * 1024)

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets were rebuilt in gradient-ready order (torch DDP's attribute: True from the
        second synced forward; never with find_unused_parameters=True). ZeRO's overlap hooks read it."""
        layout = self.reducer.layout
        return bool(layout.needs_rebuild and not layout.rebuild_pending)

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, params_and_buffers_to_ignore) -> None:
        """Mark parameters and buffers (by qualified name) that DDP neither broadcasts nor averages.

        torch DDP's static method of this name, which libraries call before wrapping a model; call it
        before minidp.DDP(module). Each rank keeps its own value of those tensors.
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if name in params_and_buffers_to_ignore:
                tensor._ddp_ignored = True

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch DDP's built-in hooks by type (dist.BuiltinCommHookType): ALLREDUCE, FP16_COMPRESS.

        torch runs them in C++; here they are torch's Python hooks that do the same arithmetic
        (divide by the world size, in fp16 for FP16_COMPRESS, then sum), so results stay bitwise DDP's.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # here: few scripts need it
        hooks = {dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
                 dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook}
        if comm_hook_type not in hooks:
            raise TypeError(f"comm_hook_type={comm_hook_type!r} must be a torch.distributed.BuiltinCommHookType "
                            "(ALLREDUCE or FP16_COMPRESS)")
        self.register_comm_hook(None if self.process_group == dist.group.WORLD else self.process_group,
                                hooks[comm_hook_type])
        self._builtin_hook_name = str(comm_hook_type)

    def _get_ddp_logging_data(self) -> dict:
        """torch DDP's logging dictionary: the keys minidp knows, with torch's values (logging_data.py)."""
        return logging_data(self)

    def _log_and_throw(self, err_type: type, err_msg: str):
        """Raise err_type(err_msg), reported by _get_ddp_logging_data() as "has_error"/"error" (torch's)."""
        log_and_raise(self, err_type, err_msg)

    def _check_comm_hook(self, hook) -> None:
        """torch DDP's registration checks of a comm hook (hook_checks.py), their errors logged as torch's."""
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as exc:
            self._log_and_throw(type(exc), str(exc))

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample the runtime values at iterations 1 to 10, then every `sample_rate`-th (100)."""
        set_sample_rate(self, sample_rate)

    def _set_static_graph(self) -> None:
        """static_graph=True after construction, before the first iteration (torch DDP's private API)."""
        if self.torch_keywords["skip_all_reduce_unused_params"]:  # as at construction (skip_unused.py)
            raise ValueError("minidp.DDP does not support skip_all_reduce_unused_params=True with "
                             "static_graph=True; use it with find_unused_parameters=True")
        if not self.static_graph:  # torch only warns when it is set already
            set_static_graph(self.reducer)
            self.static_graph = True

    def __getstate__(self) -> dict:
        """Pickle (torch.save(model), copy.deepcopy) without the process group and reducer, as DDP does.

        They hold live communication state (futures, hooks on this process's parameters); a loaded
        copy rebuilds them on the default process group (`__setstate__`), with no collective.
        """
        if self.process_group != dist.group.WORLD:  # logged, as torch DDP's
            self._log_and_throw(RuntimeError, "minidp.DDP can be pickled only on the default process group "
                                f"(as torch DDP): this one was built with process_group={self.process_group!r}")
        for keyword in ("delay_all_reduce_named_params", "mixed_precision"):  # hooks on this process's tensors
            if self.torch_keywords[keyword] is not None:
                raise RuntimeError(f"a minidp.DDP built with {keyword} cannot be pickled. "
                                   "Save model.module.state_dict() instead.")
        if self.transport is not None:
            raise RuntimeError(f"a minidp.DDP built with transport={self.transport!r} cannot be pickled: the "
                               "transport holds live communicators. Save model.module.state_dict() instead.")
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"]
        return state

    def __setstate__(self, state: dict) -> None:
        if not dist.is_initialized():
            raise RuntimeError("loading a pickled minidp.DDP needs the default process group: call "
                               "minidp.init() first (its reducer is rebuilt on that group)")
        super().__setstate__(state)
        self.process_group = dist.group.WORLD
        # Fresh, as DDP's: the first iteration uses the initial bucket layout.
        self._build_reducer([(n, p) for n, p in self.module.named_parameters()
                             if p.requires_grad and n not in self.parameters_to_ignore])
        hook, self._comm_hook = self._comm_hook, None
        if hook is not None:  # unlike torch DDP, which drops it from the rebuilt reducer
            self.register_comm_hook(*hook)

    # torch DDP's input/output helpers, kept for scripts that call them (minidp's forward needs none).
    def to_kwargs(self, inputs, kwargs, device_id):
        """`inputs` and `kwargs` moved to device `device_id` of the module's type, as DDP's: ((inputs,), (kwargs,))."""
        if not inputs and not kwargs:
            return (), ()
        device = torch.device(self.device_type, device_id)
        return ((move_inputs(inputs, device) if inputs else (),),
                (move_inputs(kwargs, device) if kwargs else {},))

    def scatter(self, inputs, kwargs, device_ids):
        """torch.nn.parallel.scatter_kwargs along `self.dim`, as DDP's."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs, output_device):
        """torch.nn.parallel.gather along `self.dim`, as DDP's."""
        return gather(outputs, output_device, dim=self.dim)
