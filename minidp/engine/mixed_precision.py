"""mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype): torch DDP's native mixed
precision; forward and backward in param_dtype, the gradients summed in reduce_dtype, fp32 weights.

What it changes in the core: the bucket kind (`MixedPrecisionBucket`) and a forward pre-hook on the
module. As torch DDP's `_setup_mixed_precision_params`, `_cast_buffers`, `_root_copy_hook` and
`_reducer_allreduce_and_upcast_hook` (torch runs these on an accelerator only):
  * at construction the module's buffers are cast to buffer_dtype (all of them, as torch does), and
    each parameter's full-precision tensor is kept (its master);
  * before each forward of the module, every parameter's data becomes a param_dtype copy of its
    data (an accumulated `.grad` is cast down too), and the floating-point inputs are cast to
    param_dtype; backward so runs in param_dtype;
  * a gradient is copied (no division) into its bucket, whose buffer is in reduce_dtype; the bucket
    is all-reduced (SUM) in reduce_dtype, then divided by the world size there; at the end of
    backward each parameter gets its master back and, as `.grad`, its slice of that buffer cast to
    the master's dtype.
The bucket layout is planned on the full-precision parameters, as torch's. minidp refuses it with
find_unused_parameters, static_graph, gradient_as_bucket_view, sparse gradients or a comm hook
(torch registers its own; minidp raises at the next forward), and refuses pickling such a wrapper.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .buckets import Bucket, Divisor, flat_view

REFUSED_WITH = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view")


def check_mixed_precision(config, flags: dict):
    """`config` (torch's _MixedPrecision, or anything with its three fields) if minidp runs it."""
    if config is None:
        return None
    fields = ("param_dtype", "reduce_dtype", "buffer_dtype")
    if not all(hasattr(config, f) for f in fields):
        raise TypeError(f"mixed_precision={config!r} must be torch.nn.parallel.distributed."
                        "_MixedPrecision(param_dtype=, reduce_dtype=, buffer_dtype=) or None")
    for name in fields:
        dtype = getattr(config, name)
        if dtype is None and name != "buffer_dtype":
            raise ValueError(f"minidp.DDP does not support mixed_precision with {name}=None; "
                             "give both param_dtype and reduce_dtype")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"mixed_precision.{name}={dtype!r} must be a floating torch.dtype")
    for flag in REFUSED_WITH:
        if flags[flag]:
            raise ValueError(f"minidp.DDP does not support mixed_precision with {flag}=True")
    return config


class MixedPrecisionState:
    """The masters and the forward pre-hook that puts low-precision copies in their place.

    Args:
        ddp: the wrapper (its module, mixed_precision, parameters_to_ignore); casts its buffers.
        sparse: by reducer parameter, whether its gradient is sparse (refused).
    """

    def __init__(self, ddp, sparse: list):
        self.ddp = ddp
        self.config = ddp.mixed_precision
        ignored = ddp.parameters_to_ignore
        self.all_params = [p for n, p in ddp.module.named_parameters() if n not in ignored]
        self.masters = {id(p): p.data for p in self.all_params}  # the full-precision tensors
        self.frozen = [p for p in self.all_params if not p.requires_grad]
        if any(sparse):
            raise ValueError("minidp.DDP does not support mixed_precision with sparse gradients")
        if self.config.buffer_dtype is not None:
            for name, buf in ddp.module.named_buffers():
                if name not in ignored:
                    buf.data = buf.to(dtype=self.config.buffer_dtype)
        ddp.module.register_forward_pre_hook(self.before_forward, with_kwargs=True)

    def before_forward(self, module, args, kwargs):
        """Low-precision copies in place of the parameters' data; floating inputs cast down."""
        if self.ddp.reducer.comm_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called "
                               "once. minidp: mixed_precision reduces the buckets itself, as torch "
                               "DDP, whose mixed precision registers its own hook")
        if not self.ddp.reducer.layout.allocate:  # world size 1: buckets all the same (they restore)
            self.ddp.reducer.layout.allocate_buffers()
        dtype = self.config.param_dtype
        with torch.no_grad():
            for p in self.all_params:
                grad, p.grad = p.grad, None
                p.data = p.data.to(dtype)
                p.grad = None if grad is None else grad.to(dtype)

        def cast(x):
            is_float = isinstance(x, torch.Tensor) and torch.is_floating_point(x)
            return x.to(dtype) if is_float and x.dtype != dtype else x
        return tree_map(cast, args), tree_map(cast, kwargs)

    def restore(self, p: torch.Tensor) -> None:
        """The parameter's master back as its data (its `.grad` dropped: the caller sets it)."""
        p.grad = None
        p.data = self.masters[id(p)]


class MixedPrecisionBucket(Bucket):
    """A bucket whose buffer is in reduce_dtype: filled by a plain copy, divided after the sum.

    Args: as buckets.Bucket's, and state: the MixedPrecisionState.
    """

    def __init__(self, index: int, param_indices: list[int], params: list, state):
        super().__init__(index, param_indices, params)
        self.state = state
        self.buffer = self.buffer.to(state.config.reduce_dtype)
        offsets = self.offsets
        self.views = [flat_view(self.buffer, o, params[i]) for i, o in zip(param_indices, offsets)]
        self.divisor = None

    def copy_in(self, slot: int, param, grad: torch.Tensor, divisor: Divisor | None) -> None:
        self.divisor = divisor  # torch's hook divides the sum instead, in reduce_dtype
        self.views[slot].copy_(grad)

    def copy_later(self, waiting: list, divisor: Divisor | None) -> None:
        self.divisor = divisor
        torch._foreach_copy_([self.views[slot] for slot, _ in waiting], [g for _, g in waiting])

    def write_back(self, result: torch.Tensor, params: list, unused: set) -> None:
        """Divide the sum by the world size (in reduce_dtype); masters back, `.grad` cast up."""
        if self.divisor is not None:
            result.div_(self.divisor.value)
        for slot, i in enumerate(self.param_indices):
            p = params[i]
            self.state.restore(p)
            p.grad = flat_view(result, self.offsets[slot], p).to(p.dtype)
        for p in self.state.frozen:  # torch casts them back at the end of backward
            p.data = self.state.masters[id(p)]
