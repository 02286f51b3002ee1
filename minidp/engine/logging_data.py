"""model._get_ddp_logging_data(): torch DDP's logging dictionary, with what minidp knows.

What it changes in the core: nothing; a forward pre-hook on the wrapper takes a sample of the
reducer's state, as torch DDP's logger does at the start of a synced forward (before the bucket
rebuild): at iterations 1 to 10, then every `sample_rate`-th (model._set_ddp_runtime_logging_sample_rate,
100 by default). The values have torch's names, types and formats (ints, or strings joined with
", "). What torch reports and minidp does not: the timings (forward_compute_time, backward_*,
avg_*: minidp measures none; model.enable_timeline() records its own), gloo_num_threads and the
nccl_* settings (the process group's, not minidp's), unused_parameter_size and
prev_iteration_grad_ready_order_indices (minidp keeps no record of past steps), join_uneven_inputs,
and can_set_static_graph (which torch 2.14 documents but no longer reports). An error raised through
`model._log_and_throw` (compat.py; torch DDP's private method) is reported as torch's logger reports
it: "has_error": 1 and "error": "<class 'ValueError'>: message" (the last one).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch._utils import _get_device_index

ENV_STRINGS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
               "cuda_visible_devices": "CUDA_VISIBLE_DEVICES",
               "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG"}
GLOO_ENV_STRINGS = {"gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
                    "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}


class RuntimeSamples:
    """The sample of the reducer's state taken before sampled synced forwards (a forward pre-hook).

    Args:
        ddp: the wrapper; the hook is registered on it.
    """

    def __init__(self, ddp):
        self.sample_rate = 100  # torch's kDDPRuntimeLoggingSampleRate
        self.sample = {}
        self.error = None  # the last error raised through log_and_raise, in torch's format
        ddp.register_forward_pre_hook(self.before_forward)

    def before_forward(self, ddp, inputs) -> None:
        if not (torch.is_grad_enabled() and ddp.require_backward_grad_sync):
            return  # torch counts and samples synced forwards only
        reducer = ddp.reducer
        iteration = reducer.iteration  # synced forwards before this one
        if iteration == 0 or (iteration > 10 and iteration % self.sample_rate):
            return
        layout = reducer.layout
        skipped = getattr(reducer.readiness, "skipped_buckets", 0)  # skip_unused.py
        first_static = ddp.static_graph and iteration == 1  # torch counts none in that iteration
        self.sample = {"iteration": iteration,
                       "has_rebuilt_buckets": int(ddp._has_rebuilt_buckets),
                       "num_buckets_reduced": 0 if first_static else len(layout.plan) - skipped}
        if self.sample["has_rebuilt_buckets"]:
            self.sample["rebuilt_bucket_sizes"] = bucket_sizes(reducer, layout.plan)
            self.sample["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, bucket)) for bucket in layout.plan)


def bucket_sizes(reducer, plan) -> str:
    """Each bucket's bytes, as torch's logger writes them."""
    sizes = [sum(reducer.params[i].numel() * reducer.params[i].element_size() for i in bucket)
             for bucket in plan]
    return ", ".join(map(str, sizes))


def dtype_names(params) -> str:
    """The parameters' dtypes as torch's logger names them (float, double, c10::Half, ...), sorted."""
    caffe2 = {"float32": "float", "float64": "double", "float16": "c10::Half",
              "bfloat16": "c10::BFloat16"}
    names = {caffe2.get(name, name) for name in (str(p.dtype).removeprefix("torch.") for p in params)}
    return ", ".join(sorted(names))  # torch's logger: a sorted set


def logging_data(ddp) -> dict:
    """torch DDP's `_get_ddp_logging_data()` keys that minidp knows, with torch's values."""
    reducer = ddp.reducer
    layout = reducer.layout
    params = reducer.params
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
        "bucket_sizes": bucket_sizes(reducer, layout.plan_with_cap(layout.cap, first_iteration=True)),
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
    if reducer.comm_hook is not None:
        hook = reducer.comm_hook
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
