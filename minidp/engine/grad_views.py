"""gradient_as_bucket_view=True: each `.grad` is its parameter's view of the bucket; a bucket kind.

What it changes in the core: nothing but the bucket. torch DDP's option saves the memory of a second
copy of the gradients and the copy back after the all-reduce: a copy into the bucket makes `.grad`
the bucket's view, so while `.grad` is kept autograd accumulates into the bucket itself; the copy-in
then only divides in place (as DDP does: `div_`, not a multiply by the reciprocal), and the reduced
buffer already is the gradients. A `.grad` made outside the bucket (the first iteration, or every one
after `zero_grad()`'s default set_to_none) is multiplied by 1/N while copied in, in one pass, as DDP
does. Large gradients are handled when ready, as in DDP; small ones wait for the launch
(layout.copy_later) and are done as one op over the flat buffer where all of a bucket's waited, not
one Python-issued op each. `ViewBucket` answers the same calls as buckets.Bucket.
"""
from __future__ import annotations

import torch

from .buckets import Bucket, Divisor, flat_view


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

    def copy_in(self, slot: int, param, grad: torch.Tensor, divisor: Divisor | None) -> None:
        """One large gradient, when ready: divided in place if it is the view, else copied in and made the view."""
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
