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

from ..engine.collectives import collective_device

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


def all_reduce_sums(values: Mapping[str, Number], group: Optional[dist.ProcessGroup] = None,
                    device: Optional[torch.device] = None) -> Dict[str, Number]:
    """Sum every value over the ranks of `group` in one all-reduce; return the sums by name.

    Every rank must call it with the same names. Integer inputs (ints, integer tensors) come back
    as ints, the others as floats. The sum runs in float64, exact for integers below 2**53.
    Without a process group it returns the values as Python numbers (a world of one).

    Args:
        values: name -> int, float or one-element tensor, e.g. {"correct": 93, "count": 100}.
        group: the process group. Default: the world.
        device: where the sum runs under NCCL (CUDA tensors only there): e.g. the model's device.
            Default None: the device of the first CUDA tensor among `values`, else the current
            CUDA device. Under gloo the sum runs on the CPU whatever `device` says.

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
        if device is None:  # the values' own GPU, not whichever is current (set_device may never be called)
            device = next((v.device for v in values.values() if isinstance(v, torch.Tensor) and v.is_cuda), None)
        buf = torch.tensor(flat, dtype=torch.float64, device=collective_device(group, device))
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)  # ranks meet here
        flat = buf.cpu().tolist()
    return {k: int(round(v)) if _is_integer(values[k]) else v for k, v in zip(names, flat)}
