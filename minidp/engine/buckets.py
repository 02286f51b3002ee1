"""The flat bucket buffers: a planned bucket's buffer and views, gradients in, reduced gradients out.

planning.py decides which parameters share a bucket; this file holds what a bucket is at run time:
  * `build_buckets` allocates one flat buffer per planned bucket, and the views through which each
    parameter's gradient is read and written (`flat_view`, with DDP's strides);
  * `copy_in` puts a gradient into its slot during backward (multiplied by 1/world_size on the
    default path, DDP's numerics), and `copy_deferred` copies the small ones in one batch at launch;
  * `write_back` gives each parameter its reduced gradient from the bucket's result.
A parameter with a sparse gradient (nn.Embedding(sparse=True)) has a bucket of its own: the gradient
itself, never packed.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """A flat buffer holding some parameters' gradients back to back, and its per-iteration state.

    A parameter with a sparse gradient has a bucket of its own, whose `buffer` is that gradient itself
    (set each iteration; sparse tensors cannot be packed into a flat buffer), with no views.
    """

    index: int
    param_indices: list[int]      # into the reducer's parameters, in buffer order
    offsets: list[int]            # element offset of each gradient in `buffer`
    buffer: torch.Tensor
    views: list[torch.Tensor]     # each parameter's gradient inside `buffer` (flat_view)
    sparse: bool = False
    pending: int = 0              # gradients still to arrive this iteration
    deferred: list = field(default_factory=list, repr=False)  # (slot, grad, param) to copy at launch
    in_place: list = field(default_factory=list, repr=False)  # slots already holding their gradient
    future: torch.futures.Future | None = field(default=None, repr=False)


def build_buckets(plan: list[list[int]], params: list, sparse: Sequence[bool]) -> list[Bucket]:
    """One buffer per planned bucket (allocated once per layout, never per step)."""
    buckets = []
    for b, indices in enumerate(plan):
        first = params[indices[0]]
        if sparse[indices[0]]:
            buckets.append(Bucket(b, list(indices), [0], no_sparse_gradient(first), [], sparse=True))
            continue
        offsets = list(itertools.accumulate((params[i].numel() for i in indices), initial=0))
        # Empty, not zeros: every slot is written (gradient or zeros) before each all-reduce.
        buffer = torch.empty(offsets.pop(), dtype=first.dtype, device=first.device)
        views = [flat_view(buffer, offset, params[i]) for i, offset in zip(indices, offsets)]
        buckets.append(Bucket(b, list(indices), offsets, buffer, views))
    return buckets


def flat_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slot of `like`'s gradient in a flat buffer: `like.numel()` elements from `offset`.

    As DDP's bucket views: with `like`'s strides when its memory is dense (e.g. channels_last
    weights get channels_last gradients, laid out in the buffer in memory order), else C-contiguous.
    """
    if like.is_contiguous() or _non_overlapping_and_dense(like):  # is_contiguous: the common case, in C
        return buffer.as_strided(like.shape, like.stride(), buffer.storage_offset() + offset)
    return buffer[offset:offset + like.numel()].view(like.shape)


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory exactly once, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def copy_in(bucket: Bucket, slot: int, param: torch.Tensor, grad: torch.Tensor, *, average: bool, divisor,
            scale, small: bool, as_bucket_view: bool) -> None:
    """Put one gradient into its bucket during backward.

    Args:
        bucket, slot: where the gradient goes (bucket.views[slot]).
        param, grad: the parameter and its gradient.
        average: the default path (no comm hook): the copy is multiplied by `scale` = 1/`divisor`, as
            DDP multiplies by the reciprocal while copying; a comm hook gets the plain sum to average.
        divisor, scale: the world size (or join()'s count) and its reciprocal.
        small: the gradient is below the reducer's SMALL_GRAD_NUMEL: it is copied at launch, in a batch.
        as_bucket_view: gradient_as_bucket_view: from now on the gradient lives in the bucket.
    """
    if bucket.sparse:  # the gradient is the buffer: divided in place (DDP), reduced, copied back
        bucket.buffer = grad.div_(divisor) if average else grad
        return
    view = bucket.views[slot]
    if grad.data_ptr() == view.data_ptr():  # already in the bucket (gradient_as_bucket_view)
        if average:
            bucket.in_place.append(slot)  # divided at launch, with the others (copy_deferred)
        return
    if small:
        bucket.deferred.append((slot, grad, param))  # copied in one batch at launch, the same products
        return
    if average:
        torch.mul(grad, scale, out=view)  # DDP: multiply by the reciprocal while copying
    else:
        view.copy_(grad)
    if as_bucket_view:
        param.grad = view


def copy_deferred(bucket: Bucket, *, average: bool, divisor, scale, as_bucket_view: bool) -> None:
    """At launch: divide the gradients already in the bucket, copy the deferred small ones in.

    As DDP: a gradient that is the bucket's view (gradient_as_bucket_view) is divided by the divisor
    in place; a copied one is multiplied by 1/divisor (on the default path; a comm hook averages).
    Arguments as copy_in's.
    """
    if bucket.in_place:
        if len(bucket.in_place) == len(bucket.views):
            bucket.buffer.div_(divisor)  # every gradient is in the bucket: one op over the flat buffer
        else:
            for slot in bucket.in_place:
                bucket.views[slot].div_(divisor)
        bucket.in_place = []
    if not bucket.deferred:
        return
    views = [bucket.views[slot] for slot, _, _ in bucket.deferred]
    torch._foreach_copy_(views, [grad for _, grad, _ in bucket.deferred])
    if average and len(views) == len(bucket.views):
        bucket.buffer.mul_(scale)  # every slot was deferred: one op over the flat buffer
    elif average:
        torch._foreach_mul_(views, scale)
    if as_bucket_view:
        for view, (_, _, param) in zip(views, bucket.deferred):
            param.grad = view
    bucket.deferred = []


def no_sparse_gradient(like: torch.Tensor) -> torch.Tensor:
    """An all-zero sparse gradient (nnz=0) shaped like an embedding's: one sparse dimension, as the
    real ones have (gloo's sparse all-reduce requires the same sparse/dense dimensions on all ranks)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=like.device),
                                   torch.empty(0, *like.shape[1:], dtype=like.dtype, device=like.device),
                                   like.shape)


def sparse_gradient_flags(module: torch.nn.Module, params: list) -> list[bool]:
    """By parameter, whether its gradient will be sparse; DDP's rule: its module is an nn.Embedding or
    nn.EmbeddingBag with sparse=True (for a shared parameter, the first module that has it)."""
    if not any(isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse for sub in module.modules()):
        return [False] * len(params)  # the common case: no sparse embedding at all
    sparse_owner: dict = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            sparse_owner.setdefault(p, isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse)
    return [sparse_owner.get(p, False) for p in params]


def write_back(bucket: Bucket, result: torch.Tensor, params: list, gradient_as_bucket_view: bool,
               globally_unused: set) -> None:
    """Each parameter of `bucket` gets its reduced gradient from `result` (the bucket's reduced buffer).

    Copied into `.grad` (in one batched op), or, with gradient_as_bucket_view, `.grad` is the bucket's
    view. A parameter no rank produced a gradient for keeps its `.grad` as it is (None), as in DDP.
    """
    if bucket.sparse:  # as DDP: the reduced values go into the gradient tensor itself
        param = params[bucket.param_indices[0]]
        if bucket.param_indices[0] not in globally_unused and param.grad is None:  # unused here only
            param.grad = result.clone()
        elif bucket.param_indices[0] not in globally_unused and result is not param.grad:
            param.grad.copy_(result)
        return
    if result is bucket.buffer and not gradient_as_bucket_view and not globally_unused:
        grads = [params[i].grad for i in bucket.param_indices]
        if all(g is not None for g in grads):  # the usual step: one batched copy, no per-gradient branches
            torch._foreach_copy_(grads, bucket.views)
            return
    copy_to, copy_from = [], []
    for slot, i in enumerate(bucket.param_indices):
        if i in globally_unused:
            continue
        param, view = params[i], bucket.views[slot]
        out = view if result is bucket.buffer else flat_view(result, bucket.offsets[slot], param)
        if gradient_as_bucket_view:
            if out is not view:
                copy_to.append(view)
                copy_from.append(out)
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                param.grad = view
        elif param.grad is None:
            param.grad = out.clone()
        else:
            copy_to.append(param.grad)
            copy_from.append(out)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)


def check_sparse_backend(params: list, names: list, sparse: Sequence[bool], backend: str) -> None:
    """Refuse sparse gradients where the backend has no sparse all-reduce, naming the parameter.

    Only gloo has one: torch DDP on NCCL constructs, then fails in backward ("allreduce_sparse is
    only available in the NCCL experimental branch").

    Args:
        backend: the process group's, e.g. "gloo", "nccl", or one per device type "cpu:gloo,cuda:nccl".
    """
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    for p, name, is_sparse in zip(params, names, sparse):
        used = per_device.get(p.device.type, backend)
        if is_sparse and used != "gloo":
            raise ValueError(
                f"parameter {name!r} gets sparse gradients (nn.Embedding/EmbeddingBag with sparse=True) on "
                f"{p.device.type}, where the process group's backend is {used!r}: only gloo can all-reduce "
                "sparse tensors. Use sparse=False, or a gloo process group.")
