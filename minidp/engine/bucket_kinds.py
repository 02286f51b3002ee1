"""The other bucket kinds: gradients as views of the bucket, sparse gradients, mixed precision.

Each answers the calls buckets.Bucket answers (copy_in, copy_later, zero_slot, zeros, write_back),
so the reducer does not tell them apart; arguments.choose picks the kind from the wrapper's keywords:
  ViewBucket             gradient_as_bucket_view=True: each `.grad` is a view of the bucket
  SparseBucket           a parameter whose gradient is sparse (nn.Embedding(sparse=True))
  MixedPrecisionBucket   mixed_precision=_MixedPrecision(...): buffers in reduce_dtype, with the
                         MixedPrecisionState that puts low-precision copies in the module
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .buckets import Bucket, Divisor, flat_view

# gradient_as_bucket_view=True: each `.grad` is its parameter's view of the bucket; a bucket kind.
#
# What it changes in the core: nothing but the bucket. torch DDP's option saves the memory of a second
# copy of the gradients and the copy back after the all-reduce: a copy into the bucket makes `.grad`
# the bucket's view, so while `.grad` is kept autograd accumulates into the bucket itself; the copy-in
# then only divides in place (as DDP does: `div_`, not a multiply by the reciprocal), and the reduced
# buffer already is the gradients. A `.grad` made outside the bucket (the first iteration, or every one
# after `zero_grad()`'s default set_to_none) is multiplied by 1/N while copied in, in one pass, as DDP
# does. Large gradients are handled when ready, as in DDP; small ones that are views already wait for
# the launch (layout.copy_later) and are divided as one op over the flat buffer where all of a
# bucket's waited, not one Python-issued op each; a small one made outside the bucket is copied in at
# once (`holds`: waiting would keep autograd's tensor alive). `ViewBucket` answers the same calls as
# buckets.Bucket.

class ViewBucket(Bucket):
    """A bucket whose views are the parameters' `.grad` (Args as buckets.Bucket's)."""

    def __init__(self, index: int, param_indices: list[int], params: list):
        super().__init__(index, param_indices, params)
        self.params = params
        self.view_ptrs = [view.data_ptr() for view in self.views]  # fixed: the buffer lives as long as the bucket
        for slot, i in enumerate(self.param_indices):  # a new layout adopts the existing gradients, as DDP's
            if params[i].grad is not None:
                self.views[slot].copy_(params[i].grad)
                params[i].grad = self.views[slot]

    def holds(self, slot: int, grad: torch.Tensor) -> bool:
        """A small gradient waits for the launch only if it is the view already. One made outside the
        bucket is copied in now, so the tensor autograd made is freed now, as torch DDP frees it: kept
        until the launch, GPT-2's small gradients scattered the heap, and the large ones freed meanwhile
        came back as fresh pages (4,500-7,000 more page faults a backward, about 40 ms of CPU)."""
        return grad.data_ptr() == self.view_ptrs[slot]

    def copy_in(self, slot: int, param, grad: torch.Tensor, divisor: Divisor | None) -> None:
        """One gradient, when ready: divided in place if it is the view, else copied in and made the view."""
        if grad.data_ptr() != self.view_ptrs[slot]:
            super().copy_in(slot, param, grad, divisor)  # multiplied by 1/N while copying, as DDP
            param.grad = self.views[slot]
        elif divisor is not None:
            self.views[slot].div_(divisor.value)

    def copy_later(self, waiting: list, divisor: Divisor | None) -> None:
        """At launch: divide the gradients already in the bucket in place, copy in the others (`.grad` -> view)."""
        copied, in_place = [], []
        for slot, grad in waiting:
            (in_place if grad.data_ptr() == self.view_ptrs[slot] else copied).append((slot, grad))
        if copied:  # a gradient made outside the bucket (first iteration, or .grad set to None)
            super().copy_later(copied, divisor)  # multiplied by 1/N while copying, as DDP
            for slot, _ in copied:
                self.params[self.param_indices[slot]].grad = self.views[slot]
        if divisor is not None and len(in_place) == len(self.views):
            self.buffer.div_(divisor.value)  # every slot waited, in place: one op over the flat buffer
        elif divisor is not None and in_place:
            torch._foreach_div_([self.views[slot] for slot, _ in in_place], divisor.value)

    def write_back(self, result: torch.Tensor, params: list, unused: set) -> None:
        hooked = result is not self.buffer  # a comm hook's result in another tensor
        for slot, i in enumerate(self.param_indices):
            if i in unused:
                continue
            view = self.views[slot]
            if hooked:
                view.copy_(flat_view(result, self.offsets[slot], params[i]))
            grad = params[i].grad
            if grad is None or grad.data_ptr() != self.view_ptrs[slot]:
                params[i].grad = view


# Sparse gradients (nn.Embedding / nn.EmbeddingBag with sparse=True): a bucket kind of their own.
#
# What it changes in the core: nothing but the bucket. A sparse tensor cannot be packed into a flat
# buffer, so each such parameter gets a `SparseBucket` (planning.py gives it a bucket of its own) whose
# buffer *is* the gradient, set each iteration, divided in place on the default path and all-reduced
# as it is (gloo has a sparse all-reduce; NCCL has none: refused at construction, naming the
# parameter). It answers the same calls as buckets.Bucket, so the reducer does not tell them apart.

class SparseBucket:
    """One parameter whose gradient is sparse; `buffer` is that gradient (or an empty one).

    Args: as buckets.Bucket's (param_indices holds one index).
    """

    sparse = True

    def __init__(self, index: int, param_indices: list[int], params: list):
        self.index, self.param_indices, self.offsets, self.views = index, list(param_indices), [0], []
        self.like = params[param_indices[0]]
        self.buffer = no_sparse_gradient(self.like)

    def copy_in(self, slot, param, grad, divisor) -> None:
        """The gradient becomes the buffer: divided in place on the default path (as DDP), reduced, copied back."""
        self.buffer = grad if divisor is None else grad.div_(divisor.value)

    def zero_slot(self, slot: int) -> None:
        self.buffer = no_sparse_gradient(self.like)

    def zeros(self) -> torch.Tensor:
        return no_sparse_gradient(self.like)

    def write_back(self, result: torch.Tensor, params: list, unused: set) -> None:
        """As DDP: the reduced values go into the gradient tensor itself (a new one if this rank had none)."""
        index = self.param_indices[0]
        param = params[index]
        if index in unused:
            return
        if param.grad is None:  # unused on this rank only
            param.grad = result.clone()
        elif result is not param.grad:
            param.grad.copy_(result)


def no_sparse_gradient(like: torch.Tensor) -> torch.Tensor:
    """An all-zero sparse gradient (nnz=0) shaped like an embedding's: one sparse dimension, as the
    real ones have (gloo's sparse all-reduce requires the same sparse/dense dimensions on all ranks)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=like.device),
                                   torch.empty(0, *like.shape[1:], dtype=like.dtype, device=like.device),
                                   like.shape)


def sparse_gradient_flags(module: torch.nn.Module, params: list, names: list, group, transport) -> list[bool]:
    """By parameter, whether its gradient will be sparse, refused where nothing can reduce it (check_sparse).

    DDP's rule: its module is an nn.Embedding or nn.EmbeddingBag with sparse=True (for a shared
    parameter, the first module that has it).
    """
    kinds = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    if not any(isinstance(sub, kinds) and sub.sparse for sub in module.modules()):
        return [False] * len(params)  # the common case: no sparse embedding at all
    sparse_owner: dict = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            sparse_owner.setdefault(p, isinstance(sub, kinds) and sub.sparse)
    flags = [sparse_owner.get(p, False) for p in params]
    check_sparse(params, names, flags, dist.get_backend(group), transport)
    return flags


def check_sparse(params: list, names: list, sparse: Sequence[bool], backend: str, transport) -> None:
    """Refuse sparse gradients where nothing can all-reduce them, naming the parameter.

    Only gloo has a sparse all-reduce: torch DDP on NCCL constructs, then fails in backward
    ("allreduce_sparse is only available in the NCCL experimental branch"). A minidp.comm transport
    carries dense buckets only.

    Args:
        backend: the process group's, e.g. "gloo", "nccl", or one per device type "cpu:gloo,cuda:nccl".
    """
    if transport is not None and any(sparse):
        raise ValueError(f"transport={transport!r} carries dense buckets only, but parameter "
                         f"{names[list(sparse).index(True)]} has a sparse gradient")
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    for p, name, is_sparse in zip(params, names, sparse):
        used = per_device.get(p.device.type, backend)
        if is_sparse and used != "gloo":
            raise ValueError(
                f"parameter {name!r} gets sparse gradients (nn.Embedding/EmbeddingBag with sparse=True) on "
                f"{p.device.type}, where the process group's backend is {used!r}: only gloo can all-reduce "
                "sparse tensors. Use sparse=False, or a gloo process group.")


# mixed_precision=_MixedPrecision(param_dtype, reduce_dtype, buffer_dtype): torch DDP's native mixed
# precision; forward and backward in param_dtype, the gradients summed in reduce_dtype, fp32 weights.
#
# What it changes in the core: the bucket kind (`MixedPrecisionBucket`) and a forward pre-hook on the
# module. As torch DDP's `_setup_mixed_precision_params`, `_cast_buffers`, `_root_copy_hook` and
# `_reducer_allreduce_and_upcast_hook` (torch runs these on an accelerator only):
#   * at construction the module's buffers are cast to buffer_dtype (all of them, as torch does), and
#     each parameter's full-precision tensor is kept (its master);
#   * before each forward of the module, every parameter's data becomes a param_dtype copy of its
#     data (an accumulated `.grad` is cast down too), and the floating-point inputs are cast to
#     param_dtype; backward so runs in param_dtype;
#   * a gradient is copied (no division) into its bucket, whose buffer is in reduce_dtype; the bucket
#     is all-reduced (SUM) in reduce_dtype, then divided by the world size there; at the end of
#     backward each parameter gets its master back and, as `.grad`, its slice of that buffer cast to
#     the master's dtype.
# The bucket layout is planned on the full-precision parameters, as torch's. minidp refuses it with
# find_unused_parameters, static_graph, gradient_as_bucket_view, sparse gradients or a comm hook
# (torch registers its own; minidp raises at the next forward), and refuses pickling such a wrapper.

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
        if self.ddp._comm_hook is not None:  # a hook registered on the wrapper
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called "
                               "once. minidp: mixed_precision reduces the buckets itself, as torch "
                               "DDP, whose mixed precision registers its own hook")
        self.ddp.reducer.allocate_buckets()  # world size 1 too: the buckets restore the masters
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
