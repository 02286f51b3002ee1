"""ZeroRedundancyOptimizer's checks of its arguments, before any collective, with torch's messages.

The messages are torch ZeroRedundancyOptimizer's (tests/test_zero.py calls both with the same bad
input and compares), so a script that catches them behaves the same under either.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch


def check_params(params: Any) -> list:
    """`params` as a list (tensors or group dicts), after torch's checks; and every parameter in it.

    Raises TypeError for a lone tensor, a non-iterable or a mix of tensors and dicts; ValueError for
    an empty list, a group dict without "params", sparse parameters or parameters of mixed types.
    """
    if isinstance(params, torch.Tensor):
        raise TypeError("`params` argument should be an iterable of Tensors, but got "
                        f"{torch.typename(params)}")
    try:
        entries = list(params)
    except TypeError as e:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from e
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    tensors, dicts = (all(isinstance(p, kind) for p in entries) for kind in (torch.Tensor, dict))
    if not (tensors or dicts):
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    check_same_dense_type(all_params(entries))
    return entries


def all_params(entries: list) -> list:
    """Every parameter of `entries` (tensors, or group dicts with a "params" key), in order."""
    if all(isinstance(p, torch.Tensor) for p in entries):
        return list(entries)
    params = []
    for group in entries:
        if "params" not in group:
            raise ValueError("Each parameter group passed-in via `params` must have a 'params' key "
                             "mapping to the parameters in the group")
        group_params = group["params"]
        params.extend([group_params] if isinstance(group_params, torch.Tensor) else group_params)
    return params


def check_same_dense_type(params: list) -> None:
    """ValueError unless every parameter is dense and of one tensor type (dtype and device kind).

    Why: a flat buffer (parameters_as_bucket_view) and a per-rank broadcast assume one dtype.
    """
    if not params:
        return
    first = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type for all "
                         f"parameters but got {first}")
    for p in params[1:]:
        other = torch.typename(p)
        if other != first:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type "
                             f"for all parameters but got both {first} and {other}")


def check_optimizer_class(optimizer_class: Any, overlap_with_ddp: bool) -> Any:
    """The optimizer class to build the local optimizer from, after torch's checks.

    TypeError unless it can be called. Functional optimizers (torch.distributed.optim.functional_*,
    whose step takes the gradients as arguments): ValueError unless overlap_with_ddp=True, where
    torch turns torch.optim classes into them; minidp steps a plain torch.optim optimizer in both
    modes (overlap.py), so it turns a functional one back into its torch.optim class (the same
    arithmetic). Recognised by module and class name, so that minidp does not import
    torch.distributed.optim (which would load torch's ZeroRedundancyOptimizer).
    """
    if getattr(optimizer_class, "__module__", "").startswith("torch.distributed.optim.functional_"):
        if not overlap_with_ddp:
            raise ValueError(f"Passing in a functional optimizer {optimizer_class} when "
                             "`overlap_with_ddp=False`")
        return getattr(torch.optim, optimizer_class.__name__.removeprefix("_Functional"))
    if not callable(optimizer_class):
        raise TypeError(f"optimizer_class={optimizer_class!r} must be an optimizer class, e.g. "
                        "torch.optim.SGD")
    return optimizer_class


def check_overlap(param_groups: list[dict], parameters_as_bucket_view: bool) -> None:
    """overlap_with_ddp=True: one parameter group (torch's RuntimeError, raised here at
    construction rather than in the third backward); parameters_as_bucket_view is ignored, with
    torch's warning."""
    if len(param_groups) != 1:
        raise RuntimeError("Specifying `params_per_rank` only supports a single parameter group "
                           "(minidp: overlap_with_ddp=True partitions DDP's buckets; got "
                           f"{len(param_groups)} parameter groups)")
    if parameters_as_bucket_view:
        warnings.warn("`parameters_as_bucket_view=True` will be ignored since "
                      "`overlap_with_ddp=True`; instead, a different bucketing strategy will be "
                      "used", stacklevel=3)


def check_reduce_scatter(overlap_with_ddp: bool, parameters_as_bucket_view: bool) -> None:
    """reduce_scatter=True: neither overlap_with_ddp (another comm hook's mode) nor
    parameters_as_bucket_view (its shard buckets are flat already)."""
    if overlap_with_ddp:
        raise ValueError("reduce_scatter=True and overlap_with_ddp=True: pick one (both replace "
                         "DDP's comm hook: hook_with_zero_reduce_scatter or hook_with_zero_step)")
    if parameters_as_bucket_view:
        raise ValueError("reduce_scatter=True and parameters_as_bucket_view=True: leave "
                         "parameters_as_bucket_view False (reduce_scatter=True puts the "
                         "parameters in flat buckets of its own)")
