"""Communication hooks: `hook(state, bucket) -> Future[Tensor]`, torch DDP's contract.

A hook receives a `GradBucket` whose `buffer()` holds the bucket's gradients back to back, starts
whatever communication it likes, and returns a `torch.futures.Future` whose value is a tensor with
the buffer's number of elements: the reduced gradients (a one-element list of it is accepted too,
which is what a collective's own `work.get_future()` holds). torch's own hooks
(`torch.distributed.algorithms.ddp_comm_hooks`: allreduce_hook, fp16_compress_hook,
bf16_compress_hook, powerSGD_hook) run on minidp unchanged.

With no hook registered, minidp runs `allreduce_sum_hook`, and the gradients were already scaled
by 1/world_size while they were copied into the bucket (DDP's numerics). A registered hook gets
the raw sum of local gradients instead, and does its own averaging, as in DDP.

The registration checks (torch DDP's `_check_comm_hook`) are in hook_checks.py.

Example: a hook that averages in fp16 through the default process group.

    def fp16_average(group, bucket):
        half = bucket.buffer().to(torch.float16).div_(dist.get_world_size(group))
        fut = dist.all_reduce(half, group=group, async_op=True).get_future()
        return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]))

    model.register_comm_hook(None, fp16_average)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GradBucket:
    """One bucket as a comm hook sees it: the flat buffer, and the parameters whose grads it holds.

    Args:
        index: the bucket's position in the launch order (0 is launched first).
        buffer: the flat gradient buffer.
        parameters: the parameters in buffer order.
        offsets: element offset of each parameter's gradient in the buffer.
        is_last: whether this is the last bucket of the iteration.
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: list, offsets: list, is_last: bool):
        self._index, self._buffer, self._params = index, buffer, parameters
        self._offsets, self._is_last = offsets, is_last

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
        return [self._buffer[o:o + p.numel()].view_as(p) for p, o in zip(self._params, self._offsets)]

    def __repr__(self) -> str:
        return f"GradBucket(index={self._index}, numel={self._buffer.numel()}, params={len(self._params)})"


def allreduce_sum_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """The default path: sum the buffer over the group, in place (grads were pre-scaled by 1/N).

    Returns the collective's own future, whose value is [buffer]: no Python callback has to run
    on the communication thread (which would need the GIL while backward runs).
    """
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)  # ranks meet here (async)
    return work.get_future()


def hook_name(hook) -> str:
    """How errors name a hook: its qualified name, else its repr (e.g. a functools.partial)."""
    return getattr(hook, "__qualname__", None) or repr(hook)


def call_comm_hook(hook, state, bucket: GradBucket) -> torch.futures.Future:
    """Run `hook(state, bucket)` and check that it returned a Future (torch's RuntimeError, its words first)."""
    future = hook(state, bucket)
    if not isinstance(future, torch._C.Future):
        raise RuntimeError(f"callback must return a torch.futures.Future object, but got {type(future).__name__}: "
                           f"communication hook {hook_name(hook)} returned {_short(future)}")
    return future


def bucket_result(value, buffer: torch.Tensor, hook) -> torch.Tensor:
    """The reduced buffer from a hook future's value: a tensor (or [tensor]) with the buffer's numel.

    Like torch DDP, a value of another dtype or device is copied over; any other value is a
    RuntimeError naming the hook (torch silently reads a prefix of a larger tensor; minidp refuses).

    Args:
        value: what the future returned by the hook resolved to.
        buffer: the bucket's flat buffer.
        hook: the hook, for the error message.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != buffer.numel():
        expected = f"a tensor of {buffer.numel()} elements (the bucket's buffer)"
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else \
            f"{type(value).__name__}: {_short(value)}"
        raise RuntimeError(f"communication hook {hook_name(hook)}: its future's value must be {expected}, "
                           f"got {got}")
    if value.dtype != buffer.dtype or value.device != buffer.device:
        value = value.to(device=buffer.device, dtype=buffer.dtype)
    return value if value.dim() == 1 else value.reshape(-1)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
