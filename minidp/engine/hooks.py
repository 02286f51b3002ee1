"""Communication hooks: `hook(state, bucket) -> Future[Tensor]`, torch DDP's contract.

A hook gets a `GradBucket` whose `buffer()` holds the bucket's gradients back to back, starts any
communication it likes, and returns a `torch.futures.Future` whose value is the reduced buffer (a
tensor of the buffer's size, or a one-element list of it, as a collective's own future holds).
torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`) run on minidp unchanged. With no
hook registered, minidp runs `allreduce_sum_hook` on gradients already scaled by 1/world_size (DDP's
numerics); a registered hook gets the raw sum and averages itself. The checks of a hook and of what
it returns, with torch DDP's errors, are in hook_checks.py.

Example: a hook that averages in fp16 through the default process group.

    def fp16_average(group, bucket):
        half = bucket.buffer().to(torch.float16).div_(dist.get_world_size(group))
        fut = dist.all_reduce(half, group=group, async_op=True).get_future()
        return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]))

    model.register_comm_hook(None, fp16_average)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

__all__ = ["GradBucket", "Transport", "allreduce_sum_hook"]


class GradBucket:
    """One bucket as a comm hook sees it: the flat buffer, and the parameters whose grads it holds.

    Args: index (in launch order), buffer (flat), parameters (in buffer order), offsets (of each
        parameter's gradient in the buffer), is_last (the last bucket of the iteration).
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list, offsets: list,
                 is_last: bool):
        self._index = index
        self._buffer = buffer
        self._params = parameters
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer that buffer() and gradients() show (as DDP's GradBucket does)."""
        self._buffer = tensor

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list:
        return list(self._params)

    def gradients(self) -> list:
        """Per-parameter views of the buffer, shaped like the parameters."""
        pairs = zip(self._params, self._offsets)
        return [self._buffer[o:o + p.numel()].view_as(p) for p, o in pairs]

    def __repr__(self) -> str:
        numel = self._buffer.numel()
        return f"GradBucket(index={self._index}, numel={numel}, params={len(self._params)})"


def allreduce_sum_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """The default path: sum the buffer over the group, in place (grads were pre-scaled by 1/N).

    Returns the collective's own future, whose value is [buffer]: no Python callback has to run
    on the communication thread (which would need the GIL while backward runs).
    """
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)  # ranks meet here
    return work.get_future()


@runtime_checkable
class Transport(Protocol):
    """What the engine needs of a `transport=` (the default all-reduce's wires, as minidp.comm's).

    The engine only knows this shape, so it never imports minidp.comm: any object with these members
    works (minidp.comm.TorchDist and CupyNccl have them).
    """

    world_size: int

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError if this transport cannot carry tensors of `device`."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start summing `tensor` over the ranks, in place; a future of the tensor (or [tensor])."""
