"""Sign: 1 bit per element plus a scale, in two stages (worker, then server), as DeepSpeed's 1-bit Adam.

DeepSpeed's compressed all-reduce (Tang et al. 2021, "1-bit Adam"), on any transport:
  worker stage: scale = ||x|| / sqrt(n); send the signs of x (packed, 8 per byte) and the scale.
      Signs go all-to-all: rank r receives every rank's signs for chunk r of the bucket only.
  server stage: rank r averages its chunk, m = sum_i scale_i * sign_i / world_size (+ its server
      error), compresses m the same way, and all-gathers its chunk's signs and scale.
Sign 0 counts as +1 (DeepSpeed's convention). With memory=ErrorFeedback(), the worker error
(x minus scale * sign(x)) is the memory's residual, and each rank also keeps the server error of
its chunk (m minus its compressed form), added back the next step. Without memory, neither is kept.

Unlike DeepSpeed (which pads the bucket with zeros that then carry signs and errors), padding
elements here are ignored: scales divide by the real element count, padding decodes to nothing.
"""
from __future__ import annotations

import math

import torch

from .exchange import Channel, Job
from .interfaces import MultiRound
from .memory import ParamStore


def _shifts(device: torch.device) -> torch.Tensor:
    """[7, 6, ..., 0] as uint8 on `device`: most significant bit first (numpy's packbits order).

    Made on the device by one kernel on the current stream, never copied from host memory: a copy
    from a pageable CPU tensor would make the host wait (4 per bucket per step). Not cached across
    calls: a tensor made on one stream and read on another would need a cross-stream wait.
    """
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bools (length a multiple of 8) to uint8, 8 per byte, first element in the top bit."""
    return (bits.view(-1, 8).to(torch.uint8) << _shifts(bits.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 (any shape) to +-1 values, 8 per byte: shape (*packed.shape[:-1], 8 * packed.shape[-1])."""
    bits = (packed.unsqueeze(-1) >> _shifts(packed.device)) & 1
    return bits.to(dtype).mul_(2).sub_(1).flatten(-2)


def signs_of(x: torch.Tensor) -> torch.Tensor:
    """+1 where x >= 0, -1 elsewhere (sign 0 counts as +1)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


def chunk_size(n: int, world_size: int) -> int:
    """Elements per server chunk: whole bytes, world_size chunks covering the n elements of a bucket."""
    return math.ceil(n / (8 * world_size)) * 8


class Sign(MultiRound):
    """1-bit sign compression with a scale, two stages (worker and server), as DeepSpeed's compressed all-reduce.

    Bytes per bucket of n elements (N = n padded to world_size chunks of whole bytes): N/8 for the
    all-to-all of signs, N/(8 * world_size) for the all-gather of the server chunk's signs, and two
    scales.
    """

    def __init__(self):
        self.server = ParamStore()  # per parameter: this rank's server error (zero outside its chunk)

    def payload_bytes(self, ctx):
        chunk = chunk_size(ctx.numel, ctx.world_size)
        return chunk * ctx.world_size // 8 + chunk // 8 + 2 * ctx.dtype.itemsize

    def reduce(self, job: Job, channel: Channel) -> torch.Tensor | None:
        x, n, ws, rank = job.tensor, job.tensor.numel(), job.ctx.world_size, job.ctx.rank
        chunk = chunk_size(n, ws)
        server_error = None
        if job.with_memory:
            server_error, _, moved = self.server.flat(job.keys, job.numels, x)
            if moved:  # new bucket layout: chunks changed owner; hand the old server error back to the worker
                x.add_(server_error, alpha=ws)
                server_error.zero_()
        # Worker stage.
        scale = torch.linalg.vector_norm(x) / math.sqrt(n)
        sent = signs_of(x)
        residual = x - scale * sent if job.with_memory else None
        bits = torch.ones(chunk * ws, dtype=torch.bool, device=x.device)
        bits[:n] = x >= 0
        received = channel.all_to_all(pack_bits(bits).view(ws, chunk // 8))  # ranks meet here
        scales = channel.all_gather(scale.reshape(1)).view(ws)  # ranks meet here
        # Server stage: the average of chunk `rank`, over what each worker sent.
        start, valid = rank * chunk, max(0, min(chunk, n - rank * chunk))
        m = (unpack_signs(received, x.dtype) * (scales * (1.0 / ws))[:, None]).sum(0)[:valid]
        if server_error is not None:
            m.add_(server_error[start:start + valid])
        server_scale = torch.linalg.vector_norm(m) / math.sqrt(max(valid, 1))
        server_sent = signs_of(m)
        if server_error is not None:
            server_error[start:start + valid] = m - server_scale * server_sent
        server_bits = torch.ones(chunk, dtype=torch.bool, device=x.device)
        server_bits[:valid] = m >= 0
        all_bits = channel.all_gather(pack_bits(server_bits))  # ranks meet here
        all_scales = channel.all_gather(server_scale.reshape(1)).view(ws, 1)  # ranks meet here
        x.copy_((unpack_signs(all_bits, x.dtype) * all_scales).view(-1)[:n])
        return residual

    def state_dict(self):
        return {"server_errors": self.server.state_dict()}

    def load_state_dict(self, state):
        self.server.load_state_dict(state["server_errors"])
