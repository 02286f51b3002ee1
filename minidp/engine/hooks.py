"""Communication hooks: `hook(state, bucket) -> Future[Tensor]`, torch DDP's contract.

A hook gets a `GradBucket` whose `buffer()` holds the bucket's gradients back to back, starts any
communication it likes, and returns a `torch.futures.Future` whose value is the reduced buffer (a
tensor of the buffer's size, or a one-element list of it, as a collective's own future holds).
torch's own hooks (`torch.distributed.algorithms.ddp_comm_hooks`) run on minidp unchanged. With no
hook registered, minidp runs `allreduce_sum_hook` on gradients already scaled by 1/world_size (DDP's
numerics); a registered hook gets the raw sum and averages itself. The checks of a hook and of what
it returns, with torch DDP's errors, are after the default hook, below.

Example: a hook that averages in fp16 through the default process group.

    def fp16_average(group, bucket):
        half = bucket.buffer().to(torch.float16).div_(dist.get_world_size(group))
        fut = dist.all_reduce(half, group=group, async_op=True).get_future()
        return fut.then(lambda f: bucket.buffer().copy_(f.value()[0]))

    model.register_comm_hook(None, fp16_average)
"""
from __future__ import annotations

import inspect
import typing
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


# torch DDP's checks of a comm hook: at registration, and of what it returns in backward.
#
# At registration (`_check_comm_hook`), a hook that is not callable is a TypeError, a `bucket` or
# return annotation other than GradBucket / Future a ValueError; in backward, a hook that returns no
# Future, or a Future whose value is not the bucket's gradients, a RuntimeError. Each message starts
# with torch DDP's own sentence (torch's own tests match on it), then names the hook. minidp is a
# little more lenient than torch: the bucket parameter need not be named `bucket`, annotations may
# be strings (`from __future__ import annotations`), and a bare `Future` return annotation passes.

def hook_name(hook) -> str:
    """How errors name a hook: its qualified name, else its repr (e.g. a functools.partial)."""
    return getattr(hook, "__qualname__", None) or repr(hook)


def check_comm_hook(hook) -> None:
    """torch DDP's registration checks (`_check_comm_hook`): TypeError or ValueError.

    Args:
        hook: the candidate `hook(state, bucket) -> Future[Tensor]`.
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. register_comm_hook: hook={hook!r} "
                        "must be callable as hook(state, bucket)")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # some builtins have no signature: nothing more to check
        return
    try:
        sig.bind(None, None)
    except TypeError:
        raise TypeError(f"register_comm_hook: hook {hook_name(hook)}{sig} must take two positional "
                        "arguments, (state, bucket)") from None
    bucket = _bucket_parameter(sig)
    buckets = (GradBucket, dist.GradBucket)
    if bucket is not None and not _names_type(bucket.annotation, buckets, "GradBucket"):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket. "
                         f"register_comm_hook: hook {hook_name(hook)}'s parameter {bucket.name!r} "
                         f"is annotated {bucket.annotation!r}")
    returns = sig.return_annotation
    futures = (torch.futures.Future, torch._C.Future)
    if not _names_type(typing.get_origin(returns) or returns, futures, "Future"):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor]. register_comm_hook: hook "
                         f"{hook_name(hook)} is annotated to return {returns!r}")


def _bucket_parameter(sig: inspect.Signature):
    """The parameter that receives the bucket: the one named `bucket` (torch's rule), else the
    second."""
    params = list(sig.parameters.values())
    if "bucket" in sig.parameters:
        return sig.parameters["bucket"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[1] if len(positional) > 1 else None


def _names_type(annotation, types: tuple, name: str) -> bool:
    """Whether an annotation is empty, one of `types`, or a string naming one (`dist.GradBucket`).
    """
    if annotation is inspect.Parameter.empty or annotation in types:
        return True
    return isinstance(annotation, str) and annotation.split("[")[0].strip().split(".")[-1] == name


def call_comm_hook(hook, state, bucket: GradBucket) -> torch.futures.Future:
    """Run `hook(state, bucket)`; not a Future back is torch's RuntimeError (its words first)."""
    future = hook(state, bucket)
    if not isinstance(future, torch._C.Future):
        raise RuntimeError("callback must return a torch.futures.Future object, but got "
                           f"{type(future).__name__}: communication hook {hook_name(hook)} "
                           f"returned {_short(future)}")
    return future


def bucket_result(value, buffer: torch.Tensor, hook) -> torch.Tensor:
    """The reduced buffer from a hook future's value: a tensor (or [tensor]) of the buffer's size.

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
        raise RuntimeError(f"communication hook {hook_name(hook)}: its future's value must be "
                           f"{expected}, got {got}")
    if value.dtype != buffer.dtype or value.device != buffer.device:
        value = value.to(device=buffer.device, dtype=buffer.dtype)
    return value if value.dim() == 1 else value.reshape(-1)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
