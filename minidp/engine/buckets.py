"""The flat bucket buffers: gradients copied in during backward, reduced gradients written back.

planning.py decides which parameters share a bucket; a `Bucket` is that decision at run time: one
flat buffer, allocated once per layout, and one view of it per parameter (`flat_view`, with DDP's
strides). On the default path a gradient is multiplied by 1/world_size while it is copied in (DDP's
numerics); a comm hook gets the plain sum and averages itself. After the all-reduce every parameter
gets its slice of the result. (A sparse gradient gets a bucket of another kind: sparse.py.)
"""
from __future__ import annotations

import itertools

import torch


class Divisor:
    """What the default path divides gradients by: the world size (join.py's count is another kind).

    `reciprocal` is DDP's 1/divisor in float64, by which a gradient is multiplied while it is copied.
    """

    def __init__(self, value: int):
        self.value, self.reciprocal = value, 1.0 / value


class Bucket:
    """A flat buffer holding some parameters' gradients back to back.

    Args:
        index: position in the launch order.
        param_indices: the reducer's parameter indices, in buffer order.
        params: all the reducer's parameters (for sizes, strides, dtype).
    """

    sparse = False

    def __init__(self, index: int, param_indices: list[int], params: list):
        self.index, self.param_indices = index, list(param_indices)
        self.offsets = list(itertools.accumulate((params[i].numel() for i in param_indices), initial=0))
        first = params[param_indices[0]]
        # Empty, not zeros: every slot is written (gradient or zeros) before each all-reduce.
        self.buffer = torch.empty(self.offsets.pop(), dtype=first.dtype, device=first.device)
        self.views = [flat_view(self.buffer, o, params[i]) for i, o in zip(param_indices, self.offsets)]

    def copy_in(self, slot: int, param, grad: torch.Tensor, divisor: Divisor | None, as_view: bool) -> None:
        """Put one gradient into its slot; `divisor` None: unscaled (a comm hook averages)."""
        view = self.views[slot]
        if grad.data_ptr() == view.data_ptr():  # already there (gradient_as_bucket_view): as DDP,
            if divisor is not None:             # divided in place
                view.div_(divisor.value)
            return
        if divisor is None:
            view.copy_(grad)
        else:
            torch.mul(grad, divisor.reciprocal, out=view)  # DDP: multiply by the reciprocal while copying
        if as_view:
            param.grad = view  # gradient_as_bucket_view: from now on the gradient lives in the bucket

    def copy_later(self, waiting: list, divisor: Divisor | None) -> None:
        """At launch: copy the small gradients that waited, `(slot, grad)` pairs, in one batched op.

        The same products as copy_in's, for one Python-issued op instead of one per gradient.
        """
        views = [self.views[slot] for slot, _ in waiting]
        torch._foreach_copy_(views, [grad for _, grad in waiting])
        if divisor is not None and len(views) == len(self.views):
            self.buffer.mul_(divisor.reciprocal)  # every slot waited: one op over the flat buffer
        elif divisor is not None:
            torch._foreach_mul_(views, divisor.reciprocal)

    def zero_slot(self, slot: int) -> None:
        """A parameter with no gradient on this rank contributes zeros."""
        self.views[slot].zero_()

    def zeros(self) -> torch.Tensor:
        """A buffer of zeros, for a rank that only matches the others' collectives (join, recovery)."""
        return torch.zeros_like(self.buffer)

    def write_back(self, result: torch.Tensor, params: list, as_view: bool, unused: set) -> None:
        """Each parameter gets its reduced gradient from `result`, this bucket's reduced buffer.

        Copied into `.grad` (one batched op), or with gradient_as_bucket_view `.grad` is the view. A
        parameter no rank produced a gradient for (`unused`) keeps its `.grad` (None), as in DDP.
        """
        if result is self.buffer and not as_view and not unused:
            grads = [params[i].grad for i in self.param_indices]
            if all(g is not None for g in grads):  # the usual step: one batched copy
                torch._foreach_copy_(grads, self.views)
                return
        copy_to, copy_from = [], []
        for slot, i in enumerate(self.param_indices):
            if i in unused:
                continue
            param, view = params[i], self.views[slot]
            out = view if result is self.buffer else flat_view(result, self.offsets[slot], param)
            if as_view and out is not view:
                copy_to.append(view)
                copy_from.append(out)
            if as_view and (param.grad is None or param.grad.data_ptr() != view.data_ptr()):
                param.grad = view
            elif not as_view and param.grad is None:
                param.grad = out.clone()
            elif not as_view:
                copy_to.append(param.grad)
                copy_from.append(out)
        if copy_to:
            torch._foreach_copy_(copy_to, copy_from)


def flat_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slot of `like`'s gradient in a flat buffer: `like.numel()` elements from `offset`.

    As DDP's bucket views: with `like`'s strides when its memory is dense (channels_last weights get
    channels_last gradients, laid out in memory order), else C-contiguous.
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
