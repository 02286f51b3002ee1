"""The torch-compat surface: what minidp.DDP has only because torch DDP has it.

Scripts and libraries written for torch DDP read its attributes, call its legacy helpers and private
APIs, pickle it, mark parameters to ignore, and read its logging dictionary. None of this is needed
to average gradients; it is here, so that ddp.py shows the engine alone: the wrapper's constructor
calls the functions (`buffer_sync`, `set_torch_attributes`), its forward
and the methods torch DDP has are those of `TorchCompat`, a base class of
minidp.DistributedDataParallel. The logging dictionary (`_get_ddp_logging_data`) is after it.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from .arguments import move_inputs
from .delayed import DelayedAllReduce
from .hooks import check_comm_hook
from .progress import RuntimeSamples, bucket_sizes
from .readiness import StaticGraph


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
    caps = ddp.torch_keywords["bucket_cap_mb_list"]  # None or MiB (layout.limits_of)
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
        cap = self.reducer.describe()["cap"]
        return int((25 if cap is None else cap) * 1024 * 1024)

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """Whether the buckets were rebuilt in gradient-ready order (torch DDP's attribute: True from the
        second synced forward; never with find_unused_parameters=True). ZeRO's overlap hooks read it."""
        return self.reducer.describe()["rebuilt"]

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
        """torch DDP's logging dictionary: the keys minidp knows, with torch's values (below)."""
        return logging_data(self)

    def _log_and_throw(self, err_type: type, err_msg: str):
        """Raise err_type(err_msg), reported by _get_ddp_logging_data() as "has_error"/"error" (torch's)."""
        log_and_raise(self, err_type, err_msg)

    def _check_comm_hook(self, hook) -> None:
        """torch DDP's registration checks of a comm hook (hooks.py), their errors logged as torch's."""
        try:
            check_comm_hook(hook)
        except (TypeError, ValueError) as exc:
            self._log_and_throw(type(exc), str(exc))

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample the runtime values at iterations 1 to 10, then every `sample_rate`-th (100)."""
        set_sample_rate(self, sample_rate)

    def _set_static_graph(self) -> None:
        """static_graph=True after construction, before the first iteration (torch DDP's private API)."""
        if self.torch_keywords["skip_all_reduce_unused_params"]:  # as at construction (readiness.py)
            raise ValueError("minidp.DDP does not support skip_all_reduce_unused_params=True with "
                             "static_graph=True; use it with find_unused_parameters=True")
        if not self.static_graph:  # torch only warns when it is set already
            self.reducer.set_static_graph(StaticGraph)
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
        state["timeline"] = None  # events and a lock: the loaded copy records none
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


# model._get_ddp_logging_data(): torch DDP's logging dictionary, with what minidp knows.
#
# What it changes in the core: nothing; a forward pre-hook on the wrapper takes a sample of the
# reducer's state, as torch DDP's logger does at the start of a synced forward (before the bucket
# rebuild): at iterations 1 to 10, then every `sample_rate`-th (model._set_ddp_runtime_logging_sample_rate,
# 100 by default). The values have torch's names, types and formats (ints, or strings joined with
# ", "). What torch reports and minidp does not: the timings (forward_compute_time, backward_*,
# avg_*: minidp measures none; model.enable_timeline() records its own), gloo_num_threads and the
# nccl_* settings (the process group's, not minidp's), unused_parameter_size and
# prev_iteration_grad_ready_order_indices (minidp keeps no record of past steps), join_uneven_inputs,
# and can_set_static_graph (which torch 2.14 documents but no longer reports). An error raised through
# `model._log_and_throw` (compat.py; torch DDP's private method) is reported as torch's logger reports
# it: "has_error": 1 and "error": "<class 'ValueError'>: message" (the last one).

ENV_STRINGS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
               "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
               "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG"}
GLOO_ENV_STRINGS = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
                    "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}


def dtype_names(params) -> str:
    """The parameters' dtypes as torch's logger names them (float, double, c10::Half, ...), sorted."""
    caffe2 = {"float32": "float", "float64": "double", "float16": "c10::Half",
              "bfloat16": "c10::BFloat16"}
    names = {caffe2.get(name, name) for name in (str(p.dtype).removeprefix("torch.") for p in params)}
    return ", ".join(sorted(names))  # torch's logger: a sorted set


def logging_data(ddp) -> dict:
    """torch DDP's `_get_ddp_logging_data()` keys that minidp knows, with torch's values."""
    known = ddp.reducer.describe()
    params = known["params"]
    group = ddp.process_group
    backend = dist.get_backend(group)
    data = {name: os.environ.get(var, "N/A") for name, var in ENV_STRINGS.items()}
    if backend == "gloo":
        data.update({name: os.environ.get(var, "N/A") for name, var in GLOO_ENV_STRINGS.items()})
    output_device = -1
    if ddp.device_ids is not None:
        given = ddp.output_device if ddp.output_device is not None else ddp.device_ids[0]
        output_device = _get_device_index(given, True)
    data.update({
        "backend_name": backend, "module_name": type(ddp.module).__name__,
        "device_ids": "" if ddp.device_ids is None else ", ".join(map(str, ddp.device_ids)),
        "dtypes": dtype_names(params),
        "bucket_sizes": bucket_sizes(params, ddp.reducer.first_iteration_plan()),
        "broadcast_buffers": int(ddp.broadcast_buffers), "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "find_unused_parameters": int(ddp.find_unused_parameters),
        "gradient_as_bucket_view": int(ddp.gradient_as_bucket_view),
        "has_sync_bn": int(any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp.module.modules())),
        "is_multi_device_module": int(ddp.is_multi_device_module), "iteration": 0,
        "num_parameter_tensors": len(params), "output_device": output_device,
        "rank": dist.get_rank(group), "world_size": dist.get_world_size(group),
        "total_parameter_size_bytes": sum(p.numel() * p.element_size() for p in params)})
    if ddp.static_graph:
        data["static_graph"] = 1
    if known["comm_hook"] is not None:
        hook = known["comm_hook"]
        data["comm_hook"] = ddp._builtin_hook_name or getattr(hook, "__qualname__", repr(hook))
    data.update(ddp._logging.sample)
    if ddp._logging.error is not None:  # torch's logger: set_error_and_log
        data.update({"has_error": 1, "error": ddp._logging.error})
    return data


def log_and_raise(ddp, err_type: type, message: str, by_reducer: bool = False):
    """Raise err_type(message), first noting it for _get_ddp_logging_data() (torch DDP's _log_and_throw).

    by_reducer: an error torch's C++ reducer raises (REDUCER_CHECK), which logs the bare message.
    """
    record = ddp.__dict__.get("_logging")  # None before construction ends (the checks come first)
    if record is not None:  # torch's format: "<class 'ValueError'>: ..."
        record.error = message if by_reducer else f"{err_type}: {message}"
    raise err_type(message)


def set_sample_rate(ddp, sample_rate: int) -> None:
    """torch DDP's _set_ddp_runtime_logging_sample_rate."""
    if sample_rate < 1:
        log_and_raise(ddp, ValueError, "DDP runtime logging sample rate should be equal or greater than 1")
    ddp._logging.sample_rate = sample_rate
