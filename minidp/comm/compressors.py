"""The built-in single-round compressors: FP16, BF16 (all-reduced), TopK, QSGD (all-gathered), RandomK.

Each says what a bucket becomes on the wire and how it comes back (the Compressor interface, in
interfaces.py); minidp.comm runs the exchange (exchange.single_round) and counts the bytes, which
each one's payload_bytes declares and the hook checks.
"""
from __future__ import annotations

import math

import torch

from ..validate import check_int, check_number
from .interfaces import Compressor


class _Cast(Compressor):
    summable, dtype = True, None

    def compress(self, tensor, ctx):
        return [tensor.to(self.dtype)]

    def decompress(self, payload, ctx):
        return payload[0].to(ctx.dtype)

    def payload_bytes(self, ctx):
        return ctx.numel * self.dtype.itemsize


class FP16(_Cast):
    """Send float16 (torch's fp16_compress_hook, bit for bit without memory)."""

    dtype = torch.float16


class BF16(_Cast):
    """Send bfloat16 (torch's bf16_compress_hook, bit for bit without memory)."""

    dtype = torch.bfloat16


def _k(ratio: float, numel: int) -> int:
    return min(numel, max(1, int(ratio * numel)))


class TopK(Compressor):
    """Send the `ratio` largest-magnitude elements of each bucket: values and int32 indices (all-gathered).

    Args:
        ratio: fraction of elements kept, in (0, 1]; k = max(1, int(ratio * numel)).
    """

    def __init__(self, ratio: float):
        self.ratio = check_number("ratio", ratio, positive=True, high=1.0)

    def compress(self, tensor, ctx):
        if ctx.numel >= 2**31:
            raise ValueError(f"TopK: a bucket of {ctx.numel} elements needs int64 indices; use a smaller bucket_cap_mb")
        _, indices = tensor.abs().topk(_k(self.ratio, ctx.numel), sorted=False)
        return [tensor[indices], indices.to(torch.int32)]

    def decompress(self, payload, ctx):
        values, indices = payload
        return values.new_zeros(ctx.numel).index_put_((indices.long(),), values)

    def aggregate(self, payloads, ctx):
        total = payloads[0][0].new_zeros(ctx.numel)
        for values, indices in payloads:  # one rank at a time: its indices are distinct, the sum deterministic
            total.index_add_(0, indices.long(), values)
        return total

    def payload_bytes(self, ctx):
        return _k(self.ratio, ctx.numel) * (ctx.dtype.itemsize + 4)

    def __repr__(self):
        return f"TopK(ratio={self.ratio})"


class RandomK(Compressor):
    """Send `ratio` of the elements at random positions; every rank draws the same positions.

    The positions come from the context's generator, seeded alike on every rank (shared_seed), so
    only the values travel, and they can be summed: RandomK is all-reduced. Values are not rescaled
    (use ErrorFeedback to deliver the rest later).

    Args:
        ratio: fraction of elements sent, in (0, 1]; k = max(1, int(ratio * numel)).
        seed: the generator's seed, equal on every rank. Default 0.
    """

    summable, shared_seed = True, True

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = check_number("ratio", ratio, positive=True, high=1.0)
        self.seed = check_int("seed", seed, low=0)

    def compress(self, tensor, ctx):
        k = _k(self.ratio, ctx.numel)
        # kept on ctx for decompress; the same on every rank, so other ranks' payloads decode with them too
        ctx.indices = torch.randperm(ctx.numel, generator=ctx.generator, device=tensor.device)[:k]
        return [tensor[ctx.indices]]

    def decompress(self, payload, ctx):
        return payload[0].new_zeros(ctx.numel).index_put_((ctx.indices,), payload[0])

    def payload_bytes(self, ctx):
        return _k(self.ratio, ctx.numel) * ctx.dtype.itemsize

    def __repr__(self):
        return f"RandomK(ratio={self.ratio}, seed={self.seed})"


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): each element as sign * level / levels of its block's norm, stochastically rounded.

    Unbiased. Sends one int8 per element (int16 when levels > 127; no bit packing, so levels up to
    127 all cost one byte) plus one norm per block of `block_size` elements; all-gathered (each
    rank's norms differ). With ErrorFeedback, use enough levels that the quantization error stays
    below the signal (variance factor min(d/s^2, sqrt(d)/s) < 1 for blocks of d): with QSGD(2) and
    blocks of 512 the residual grows without bound and training diverges.

    Args:
        levels: quantization levels s >= 1 (QSGD's s); 1 is ternary. At most 32767.
        block_size: elements sharing one norm. Default 512 (the QSGD paper's bucket size).
        seed: seed of the rounding noise; each rank's generator starts at seed + its rank. Default 0.
    """

    def __init__(self, levels: int, block_size: int = 512, seed: int = 0):
        self.levels = check_int("levels", levels, low=1, high=32767)
        self.block_size = check_int("block_size", block_size, low=1)
        self.int_dtype = torch.int8 if self.levels <= 127 else torch.int16
        self.seed = check_int("seed", seed, low=0)

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        count = math.ceil(flat.numel() / self.block_size)
        pad = count * self.block_size - flat.numel()
        return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(count, self.block_size)

    def compress(self, tensor, ctx):
        blocks = self._blocks(tensor)
        norms = torch.linalg.vector_norm(blocks, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = blocks.abs() / safe[:, None] * self.levels  # in [0, levels]
        low = scaled.floor()
        noise = torch.rand(scaled.shape, generator=ctx.generator, device=tensor.device, dtype=tensor.dtype)
        level = (low + (noise < scaled - low).to(low.dtype)).clamp_(max=self.levels)
        signed = (level * blocks.sign()).to(self.int_dtype).view(-1)[:ctx.numel]
        return [norms, signed]

    def decompress(self, payload, ctx):
        norms, signed = payload
        blocks = self._blocks(signed.to(norms.dtype))
        return (blocks * (norms / self.levels)[:, None]).view(-1)[:ctx.numel]

    def payload_bytes(self, ctx):
        blocks = math.ceil(ctx.numel / self.block_size)
        return ctx.numel * self.int_dtype.itemsize + blocks * ctx.dtype.itemsize

    def __repr__(self):
        return f"QSGD(levels={self.levels}, block_size={self.block_size})"
