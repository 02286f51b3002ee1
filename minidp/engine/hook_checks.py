"""torch DDP's checks of a comm hook at registration (`_check_comm_hook`), its words first.

A feature beside the hook contract (hooks.py): a hook that is not callable is a TypeError, a
`bucket` or return annotation other than GradBucket / Future a ValueError, each message starting
with torch DDP's own sentence (torch's own tests match on it). minidp is a little more lenient than
torch: the bucket parameter need not be named `bucket`, annotations may be strings
(`from __future__ import annotations`), and a bare `Future` return annotation is accepted.
"""
from __future__ import annotations

import inspect
import typing

import torch
import torch.distributed as dist

from .hooks import GradBucket, hook_name


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
