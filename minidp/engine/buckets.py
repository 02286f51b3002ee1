"""The flat bucket buffers: gradients copied in during backward, reduced gradients written back.

A `Bucket` is one flat buffer, allocated once per layout, with a view per parameter (`flat_view`,
DDP's strides). On the default path a gradient is multiplied by 1/world_size while it is copied in
(DDP's numerics); a comm hook gets the plain sum. (Other kinds: bucket_kinds.py.)
"""
from __future__ import annotations

import itertools

import torch


class Divisor:
    """The default path's divisor: the world size, with DDP's float64 1/N (join.py: a count)."""

    def __init__(self, value: int):
        self.value = value
        self.reciprocal = 1.0 / value


class Bucket:
    """A flat buffer holding some parameters' gradients back to back.

    Args:
        index: position in the launch order. param_indices: the reducer's parameters it holds, in
            buffer order. params: all the reducer's parameters (sizes, strides, dtype).
    """

    sparse = False

    def __init__(self, index: int, param_indices: list[int], params: list):
        self.index = index
        self.param_indices = list(param_indices)
        self.offsets = [0, *itertools.accumulate(params[i].numel() for i in param_indices)]
        first = params[param_indices[0]]
        # Empty, not zeros: every slot is written (gradient or zeros) before each all-reduce.
        self.buffer = torch.empty(self.offsets.pop(), dtype=first.dtype, device=first.device)
        slots = zip(param_indices, self.offsets)
        self.views = [flat_view(self.buffer, offset, params[i]) for i, offset in slots]

    def copy_in(self, slot: int, param, grad: torch.Tensor, divisor: Divisor | None) -> None:
        """Put one gradient into its slot; `divisor` None: unscaled (a comm hook averages)."""
        if divisor is None:
            self.views[slot].copy_(grad)
        else:
            torch.mul(grad, divisor.reciprocal, out=self.views[slot])  # DDP: times 1/N, copying

    def holds(self, slot: int, grad: torch.Tensor) -> bool:
        """Whether a small gradient may wait for the launch (copy_later) rather than be copied now.
        Here yes: it lives on as `.grad` anyway, so waiting keeps nothing alive."""
        return True

    def copy_later(self, waiting: list, divisor: Divisor | None) -> None:
        """At launch: copy the small gradients that waited, (slot, grad) pairs, in one batch."""
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
        """A buffer of zeros, for a rank that only matches the others' collectives (join.py)."""
        return torch.zeros_like(self.buffer)

    def write_back(self, result: torch.Tensor, params: list, unused: set) -> None:
        """Each parameter's `.grad` gets its slice of `result`, the reduced buffer (in one batch).

        A parameter no rank produced a gradient for (`unused`) keeps its `.grad` (None), as in DDP.
        """
        grads = []
        slices = []
        for slot, i in enumerate(self.param_indices):
            if i in unused:
                continue
            out = (self.views[slot] if result is self.buffer
                   else flat_view(result, self.offsets[slot], params[i]))
            if params[i].grad is None:  # no gradient on this rank (find_unused_parameters)
                params[i].grad = out.clone()
            else:
                grads.append(params[i].grad)
                slices.append(out)
        if grads:
            torch._foreach_copy_(grads, slices)


def flat_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like.numel()` elements of a flat buffer from `offset`, shaped like `like`, as DDP's bucket
    views: with `like`'s strides if its memory is dense (channels_last stays), else contiguous."""
    if like.is_contiguous() or _non_overlapping_and_dense(like):  # the common case first, in C
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
