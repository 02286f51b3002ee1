"""What a method works with inside the hook: the bucket as a Job, a byte-counting Channel, the single round.

Everything here runs on the hook's worker thread (see hook.py), one bucket after another, so the
collectives of consecutive buckets are issued in the same order on every rank. single_round is the
exchange of every single-round Compressor; a MultiRound method runs its own over the Channel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .context import Context
from .transports import Transport


@dataclass
class Job:
    """One bucket, as a method sees it.

    tensor: the flat bucket (this rank's gradient sum, with the memory's residual already added);
        the exchange overwrites it with the average over ranks.
    keys, numels: each parameter's stable key (see memory.ParamStore) and size, in buffer order.
    with_memory: whether a memory wants the residual back.
    ctx: rank, world size, step, shapes, dtype, device and generator (see context.Context).
    """

    tensor: torch.Tensor
    keys: list[int]
    numels: list[int]
    with_memory: bool
    ctx: Context


class Channel:
    """A transport, used synchronously, counting every byte this rank hands to a collective.

    Empty tensors are skipped (every rank holds the same shapes, so every rank skips them).
    """

    def __init__(self, transport: Transport):
        self.transport, self.bytes_sent = transport, 0

    def _count(self, tensor: torch.Tensor) -> bool:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        return tensor.numel() > 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `tensor`."""
        if self._count(tensor):
            self.transport.all_reduce(tensor).wait()  # ranks meet here
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked: shape (world_size, *tensor.shape)."""
        out = tensor.new_empty((self.transport.world_size, *tensor.shape))
        if self._count(tensor):
            self.transport.all_gather(out.view(-1), tensor.contiguous().view(-1)).wait()  # ranks meet here
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Chunk r of `tensor` (split on dim 0) goes to rank r; chunk r of the result came from rank r."""
        out = torch.empty_like(tensor)
        if self._count(tensor):
            self.transport.all_to_all(out.view(-1), tensor.contiguous().view(-1)).wait()  # ranks meet here
        return out

    def all_gather_parts(self, parts: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """All-gather a payload of several tensors (any dtypes) as one byte buffer: one collective.

        Returns, for each rank, its parts with their shapes and dtypes. Every rank's parts must have
        the same shapes and dtypes (a compressor's payload size depends only on the bucket size).
        """
        flat = [p.contiguous().reshape(-1).view(torch.uint8) for p in parts]
        gathered = self.all_gather(torch.cat(flat))  # (world_size, total bytes)
        result = []
        for row in gathered:
            offset, mine = 0, []
            for part, raw in zip(parts, flat):
                # clone: a dtype view needs its byte offset aligned to the element size
                chunk = row[offset:offset + raw.numel()].clone()
                mine.append(chunk.view(part.dtype).view(part.shape))
                offset += raw.numel()
            result.append(mine)
        return result


def single_round(compressor, job: Job, channel: Channel) -> torch.Tensor | None:
    """Average job.tensor over ranks in place with a single-round Compressor; the residual if job.with_memory.

    Args:
        compressor: a comm.Compressor (compress, decompress, aggregate, summable).
        job: the bucket and its Context.
        channel: the byte-counting transport.
    """
    x, ctx = job.tensor, job.ctx
    payload = compressor.compress(x, ctx)
    if not isinstance(payload, (list, tuple)) or not all(isinstance(part, torch.Tensor) for part in payload):
        raise TypeError(f"compressor={compressor!r}: compress(tensor, ctx) must return a list of tensors (the "
                        f"payload), got {type(payload).__name__}")
    residual = x - compressor.decompress(payload, ctx) if job.with_memory else None
    if compressor.summable:
        for part in payload:
            part.div_(ctx.world_size)  # average in the payload's own dtype, as torch's fp16 hook does
            channel.all_reduce(part)  # ranks meet here
        x.copy_(compressor.decompress(payload, ctx))
    else:
        gathered = channel.all_gather_parts(list(payload))  # ranks meet here
        x.copy_(compressor.aggregate(gathered, ctx).div_(ctx.world_size))
    return residual
