"""parameters_as_bucket_view=True: each rank's shard of the parameters lives in one flat buffer.

Without it, the step ends with one broadcast per parameter. With it, every rank's trainable
parameters on one device are views into one flat tensor (param.data points into it), so the step
ends with one broadcast per rank and device: fewer, larger messages. The optimizer still updates
each parameter in place, which writes straight into the buffer, so nothing is copied before
sending.

Frozen parameters (requires_grad=False) stay out of a buffer: the optimizer never changes them, so
there is nothing to send. A rank with no trainable parameter on a device still gets a one-element
buffer, so that every rank issues the same broadcasts in the same order.
"""
from __future__ import annotations

import torch


def params_by_device(partition: list[list[dict]]) -> dict[torch.device, list[list[torch.Tensor]]]:
    """device -> one list per rank of that rank's parameters on the device, in partition order.

    Devices come in the order their first parameter appears, the same on every rank (the ranks hold
    the same model), so the broadcasts that follow line up across ranks.
    """
    world_size = len(partition)
    found: dict[torch.device, list[list[torch.Tensor]]] = {}
    for rank, groups in enumerate(partition):
        for group in groups:
            for p in group["params"]:
                found.setdefault(p.device, [[] for _ in range(world_size)])[rank].append(p)
    return found


def flatten_into_buffer(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat tensor holding the trainable `params` back to back; each one's data becomes a view.

    A frozen parameter gets a copy of its data of its own: it may still be a view into an earlier
    buffer (trainability changed since), which it must not keep alive nor share.
    """
    trainable = []
    for p in params:
        if p.requires_grad:
            trainable.append(p)
        else:
            p.data = p.data.detach().clone()
    if not trainable:
        return torch.zeros(1, device=device)  # a placeholder: every rank broadcasts one per rank
    flat = torch.empty(sum(p.numel() for p in trainable), dtype=trainable[0].dtype, device=device)
    offset = 0
    for p in trainable:
        view = flat[offset:offset + p.numel()]
        view.copy_(p.data.flatten())
        p.data = view.view_as(p.data)  # the parameter's storage is now the buffer's
        offset += p.numel()
    return flat


def build_buffers(partition: list[list[dict]]) -> list[list[torch.Tensor]]:
    """buffers[d][rank]: rank's flat buffer on the d-th device; what one broadcast per rank sends.

    Args:
        partition: partition_parameters()'s answer (every rank's groups).
    """
    return [[flatten_into_buffer(params, device) for params in per_rank]
            for device, per_rank in params_by_device(partition).items()]
