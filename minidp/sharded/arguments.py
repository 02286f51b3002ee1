"""ZeroRedundancyOptimizer's checks of its arguments, before any collective, with torch's messages.

The messages are torch ZeroRedundancyOptimizer's (tests/test_zero.py calls both with the same bad
input and compares), so a script that catches them behaves the same under either.
"""
from __future__ import annotations

from typing import Any

import torch


def check_params(params: Any) -> list:
    """`params` as a list (tensors or group dicts), after torch's checks; and every parameter in it.

    Raises TypeError for a lone tensor, a non-iterable or a mix of tensors and dicts; ValueError for
    an empty list, a group dict without "params", sparse parameters or parameters of mixed types.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    try:
        entries = list(params)
    except TypeError as e:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from e
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in entries):
        all_params = entries
    elif all(isinstance(p, dict) for p in entries):
        all_params = []
        for group in entries:
            if "params" not in group:
                raise ValueError("Each parameter group passed-in via `params` must have a 'params' key "
                                 "mapping to the parameters in the group")
            group_params = group["params"]
            all_params.extend([group_params] if isinstance(group_params, torch.Tensor) else group_params)
    else:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    check_same_dense_type(all_params)
    return entries


def check_same_dense_type(params: list) -> None:
    """ValueError unless every parameter is dense and of one tensor type (dtype and device kind).

    Why: a flat buffer (parameters_as_bucket_view) and a per-rank broadcast assume one dtype.
    """
    if not params:
        return
    first = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters "
                         f"but got {first}")
    for p in params[1:]:
        other = torch.typename(p)
        if other != first:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type for all "
                             f"parameters but got both {first} and {other}")


def check_optimizer_class(optimizer_class: Any) -> None:
    """TypeError unless `optimizer_class` can be called; ValueError for torch's functional optimizers.

    Functional optimizers (torch.distributed.optim.functional_*) take gradients as step() arguments:
    torch accepts them only for overlap_with_ddp=True. Recognised by module name, so that minidp
    does not import torch.distributed.optim (which would load torch's ZeroRedundancyOptimizer).
    """
    if getattr(optimizer_class, "__module__", "").startswith("torch.distributed.optim.functional_"):
        raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")
    if not callable(optimizer_class):
        raise TypeError(f"optimizer_class={optimizer_class!r} must be an optimizer class, e.g. torch.optim.SGD")


def check_overlap(overlap_with_ddp: Any) -> None:
    """NotImplementedError for overlap_with_ddp=True: the step inside backward is not written yet."""
    if overlap_with_ddp:
        raise NotImplementedError(
            "overlap_with_ddp=True (the optimizer step inside DDP's backward, torch's hook_with_zero_step) "
            "is not implemented in minidp.ZeroRedundancyOptimizer yet: pass overlap_with_ddp=False and call "
            "step() after backward")
