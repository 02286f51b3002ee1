"""Sum evaluation counts over the ranks, so a metric over the whole data set comes out exact.

Pair it with DistributedSampler(..., pad=False) (the exact mode): each sample is then evaluated on
exactly one rank, and summing per-rank counts (correct predictions, samples, loss sums) counts each
sample once. Average only after the sum: the mean of per-rank accuracies is wrong when ranks hold
different numbers of samples.
"""
from __future__ import annotations

import numbers
from typing import Dict, Mapping, Optional, Union

import torch
import torch.distributed as dist

Number = Union[int, float, torch.Tensor]


def _as_float(name: str, value: Number) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} is a tensor of shape {tuple(value.shape)}; give one number per name")
        return float(value.detach().cpu().item())
    # Not validate.check_number: that refuses NaN, and a NaN loss is data to report here, not a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be an int, a float or a one-element tensor")
    return float(value)


def _is_integer(value: Number) -> bool:
    if isinstance(value, torch.Tensor):
        return not (value.is_floating_point() or value.is_complex())
    return isinstance(value, numbers.Integral)


def all_reduce_sums(values: Mapping[str, Number], group: Optional[dist.ProcessGroup] = None) -> Dict[str, Number]:
    """Sum every value over the ranks of `group` in one all-reduce; return the sums by name.

    Every rank must call it with the same names. Integer inputs (ints, integer tensors) come back
    as ints, the others as floats. The sum runs in float64, exact for integers below 2**53.
    Without a process group it returns the values as Python numbers (a world of one).

    Args:
        values: name -> int, float or one-element tensor, e.g. {"correct": 93, "count": 100}.
        group: the process group. Default: the world.

    Example:
        sampler = minidp.DistributedSampler(val_set, shuffle=False, pad=False)
        ...
        sums = minidp.all_reduce_sums({"correct": correct, "count": count})
        accuracy = sums["correct"] / sums["count"]
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"values={values!r} must be a mapping of name -> number, e.g. {{'correct': 3}}")
    names = sorted(values)  # one fixed order on every rank, whatever order the dict was built in
    if not names:
        return {}
    flat = [_as_float(k, values[k]) for k in names]
    if dist.is_available() and dist.is_initialized():
        # NCCL reduces CUDA tensors only; gloo (and the others) take CPU tensors.
        on_cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        buf = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)  # ranks meet here
        flat = buf.cpu().tolist()
    return {k: int(round(v)) if _is_integer(values[k]) else v for k, v in zip(names, flat)}
