"""torch DDP's checks of a comm hook (hooks.py): at registration, and of what it returns in backward.

At registration (`_check_comm_hook`), a hook that is not callable is a TypeError, a `bucket` or return
annotation other than GradBucket / Future a ValueError; in backward, a hook that returns no Future, or
a Future whose value is not the bucket's gradients, a RuntimeError. Each message starts with torch
DDP's own sentence (torch's own tests match on it), then names the hook. minidp is a little more lenient than
torch: the bucket parameter need not be named `bucket`, annotations may be strings
(`from __future__ import annotations`), and a bare `Future` return annotation is accepted.
"""
from __future__ import annotations

import inspect
import typing

import torch
import torch.distributed as dist

from .hooks import GradBucket


def hook_name(hook) -> str:
    """How errors name a hook: its qualified name, else its repr (e.g. a functools.partial)."""
    return getattr(hook, "__qualname__", None) or repr(hook)


def check_comm_hook(hook) -> None:
    """torch DDP's registration checks (`_check_comm_hook`): TypeError or ValueError, naming the hook too.

    Args:
        hook: the candidate `hook(state, bucket) -> Future[Tensor]`.
    """
    if not callable(hook):
        raise TypeError(f"Communication hook must be callable. register_comm_hook: hook={hook!r} must be "
                        "callable as hook(state, bucket)")
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
    if bucket is not None and not _names_type(bucket.annotation, (GradBucket, dist.GradBucket), "GradBucket"):
        raise ValueError(f"Communication hook: bucket annotation should be dist.GradBucket. register_comm_hook: "
                         f"hook {hook_name(hook)}'s parameter {bucket.name!r} is annotated {bucket.annotation!r}")
    returns = sig.return_annotation
    if not _names_type(typing.get_origin(returns) or returns, (torch.futures.Future, torch._C.Future), "Future"):
        raise ValueError("Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
                         f"register_comm_hook: hook {hook_name(hook)} is annotated to return {returns!r}")


def _bucket_parameter(sig: inspect.Signature):
    """The parameter that receives the bucket: the one named `bucket` (torch's rule), else the second."""
    params = list(sig.parameters.values())
    if "bucket" in sig.parameters:
        return sig.parameters["bucket"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[1] if len(positional) > 1 else None


def _names_type(annotation, types: tuple, name: str) -> bool:
    """Whether an annotation is empty, one of `types`, or a string naming one (`dist.GradBucket`)."""
    if annotation is inspect.Parameter.empty or annotation in types:
        return True
    return isinstance(annotation, str) and annotation.split("[")[0].strip().split(".")[-1] == name


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
