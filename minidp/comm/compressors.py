"""Compressors: what a bucket becomes on the wire, and how it comes back. FP16, BF16, TopK, RandomK, QSGD.

A compressor turns a flat bucket into a payload (a list of tensors) and back. If payloads can be
summed element by element (`summable = True`: casts, or sparse values at indices shared by seed),
each part is divided by the world size and all-reduced. Otherwise (top-k's own indices, QSGD's
per-rank norms) every rank's payload is all-gathered, decompressed and summed in rank order, so
every rank computes the same bits. Multi-round methods override `reduce` (sign.py, powersgd.py).

To write one (examples/custom_hook.py has a whole one):

    class Half(Compressor):
        summable = True
        def compress(self, tensor):            return [tensor.half()], tensor.dtype
        def decompress(self, payload, ctx):    return payload[0].to(ctx)
        def payload_bytes(self, shapes, dtype, world_size): return 2 * numel(shapes)
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..validate import check_int, check_number
from .exchange import Channel, Job


class Compressor:
    """The interface (see the module docstring). Subclasses implement compress/decompress/payload_bytes."""

    summable = False

    def check(self, tensor: torch.Tensor) -> None:
        """Raise TypeError if this compressor cannot take `tensor` (by default: not floating point)."""
        if not tensor.is_floating_point():
            raise TypeError(f"compressor={self!r} needs a floating-point bucket, got dtype {tensor.dtype}")

    def compress(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """(payload, ctx): the tensors to send, and what decompress needs besides them."""
        raise NotImplementedError

    def decompress(self, payload: list[torch.Tensor], ctx) -> torch.Tensor:
        """A flat dense tensor with the bucket's numel, from one payload (or the sum of summable ones)."""
        raise NotImplementedError

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx) -> torch.Tensor:
        """The sum of every rank's decompressed payload, in rank order (same bits on every rank)."""
        total = self.decompress(payloads[0], ctx).clone()
        for payload in payloads[1:]:
            total.add_(self.decompress(payload, ctx))
        return total

    def payload_bytes(self, shapes: list, dtype: torch.dtype, world_size: int) -> int:
        """Analytical bytes this rank hands to collectives for a bucket of gradients of these shapes."""
        raise NotImplementedError

    def reduce(self, job: Job, channel: Channel) -> torch.Tensor | None:
        """Average job.tensor over ranks in place; return the residual (meant minus sent) if job.with_memory."""
        x = job.tensor
        payload, ctx = self.compress(x)
        residual = x - self.decompress(payload, ctx) if job.with_memory else None
        if self.summable:
            for part in payload:
                part.div_(job.world_size)  # average in the payload's own dtype, as torch's fp16 hook does
                channel.all_reduce(part)  # ranks meet here
            x.copy_(self.decompress(payload, ctx))
        else:
            gathered = channel.all_gather_parts(payload)  # ranks meet here
            x.copy_(self.aggregate(gathered, ctx).div_(job.world_size))
        return residual

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class _Cast(Compressor):
    summable, dtype = True, None

    def compress(self, tensor):
        return [tensor.to(self.dtype)], tensor.dtype

    def decompress(self, payload, ctx):
        return payload[0].to(ctx)

    def payload_bytes(self, shapes, dtype, world_size):
        return numel(shapes) * torch.finfo(self.dtype).bits // 8

    def __repr__(self):
        return f"{type(self).__name__}()"


class FP16(_Cast):
    """Send float16 (torch's fp16_compress_hook, bit for bit without memory)."""

    dtype = torch.float16


class BF16(_Cast):
    """Send bfloat16 (torch's bf16_compress_hook, bit for bit without memory)."""

    dtype = torch.bfloat16


def numel(shapes: list) -> int:
    """Elements in a bucket holding gradients of these shapes."""
    return sum(math.prod(shape) for shape in shapes)


def _k(ratio: float, numel: int) -> int:
    return min(numel, max(1, int(ratio * numel)))


class TopK(Compressor):
    """Send the `ratio` largest-magnitude elements of each bucket: values and int32 indices (all-gathered).

    Args:
        ratio: fraction of elements kept, in (0, 1]; k = max(1, int(ratio * numel)).
    """

    def __init__(self, ratio: float):
        self.ratio = check_number("ratio", ratio, positive=True, high=1.0)

    def compress(self, tensor):
        numel = tensor.numel()
        if numel >= 2**31:
            raise ValueError(f"TopK: a bucket of {numel} elements needs int64 indices; use a smaller bucket_cap_mb")
        _, indices = tensor.abs().topk(_k(self.ratio, numel), sorted=False)
        return [tensor[indices], indices.to(torch.int32)], numel

    def decompress(self, payload, numel):
        values, indices = payload
        return values.new_zeros(numel).index_put_((indices.long(),), values)

    def aggregate(self, payloads, numel):
        total = payloads[0][0].new_zeros(numel)
        for values, indices in payloads:  # one rank at a time: its indices are distinct, the sum deterministic
            total.index_add_(0, indices.long(), values)
        return total

    def payload_bytes(self, shapes, dtype, world_size):
        k = _k(self.ratio, numel(shapes))
        return k * (torch.empty((), dtype=dtype).element_size() + 4)

    def __repr__(self):
        return f"TopK(ratio={self.ratio})"


class _Seeded:
    """Private torch.Generators, one per device, seeded alike; never the global RNG."""

    def __init__(self, seed: int):
        self.seed, self.generators = seed, {}

    def get(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    def state_dict(self) -> dict:
        return {key: gen.get_state() for key, gen in self.generators.items()}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            self.get(torch.device(key)).set_state(value)


class RandomK(Compressor):
    """Send `ratio` of the elements at random positions; every rank draws the same positions.

    The positions come from a private torch.Generator seeded alike on every rank, so only the
    values travel, and they can be summed: RandomK is all-reduced. Values are not rescaled (use
    ErrorFeedback to deliver the rest later).

    Args:
        ratio: fraction of elements sent, in (0, 1]; k = max(1, int(ratio * numel)).
        seed: the generator's seed, equal on every rank. Default 0.
    """

    summable = True

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = check_number("ratio", ratio, positive=True, high=1.0)
        self.rng = _Seeded(check_int("seed", seed, low=0))

    def compress(self, tensor):
        numel = tensor.numel()
        gen = self.rng.get(tensor.device)
        indices = torch.randperm(numel, generator=gen, device=tensor.device)[:_k(self.ratio, numel)]
        return [tensor[indices]], (numel, indices)

    def decompress(self, payload, ctx):
        numel, indices = ctx
        return payload[0].new_zeros(numel).index_put_((indices,), payload[0])

    def payload_bytes(self, shapes, dtype, world_size):
        return _k(self.ratio, numel(shapes)) * torch.empty((), dtype=dtype).element_size()

    def state_dict(self):
        return {"generators": self.rng.state_dict()}

    def load_state_dict(self, state):
        self.rng.load_state_dict(state["generators"])

    def __repr__(self):
        return f"RandomK(ratio={self.ratio}, seed={self.rng.seed})"


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
        seed: seed of this rank's private generator (offset by the global rank). Default 0.
    """

    def __init__(self, levels: int, block_size: int = 512, seed: int = 0):
        self.levels = check_int("levels", levels, low=1, high=32767)
        self.block_size = check_int("block_size", block_size, low=1)
        self.int_dtype = torch.int8 if self.levels <= 127 else torch.int16
        self.seed = check_int("seed", seed, low=0)
        self.rng = None  # seeded at first use, when the rank is known

    def _blocks(self, flat: torch.Tensor) -> torch.Tensor:
        count = math.ceil(flat.numel() / self.block_size)
        pad = count * self.block_size - flat.numel()
        return (torch.cat([flat, flat.new_zeros(pad)]) if pad else flat).view(count, self.block_size)

    def compress(self, tensor):
        if self.rng is None:
            self.rng = _Seeded(self.seed + (dist.get_rank() if dist.is_initialized() else 0))
        blocks = self._blocks(tensor)
        norms = torch.linalg.vector_norm(blocks, dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        scaled = blocks.abs() / safe[:, None] * self.levels  # in [0, levels]
        low = scaled.floor()
        noise = torch.rand(scaled.shape, generator=self.rng.get(tensor.device), device=tensor.device,
                           dtype=tensor.dtype)
        level = (low + (noise < scaled - low).to(low.dtype)).clamp_(max=self.levels)
        signed = (level * blocks.sign()).to(self.int_dtype).view(-1)[:tensor.numel()]
        return [norms, signed], tensor.numel()

    def decompress(self, payload, numel):
        norms, signed = payload
        blocks = self._blocks(signed.to(norms.dtype))
        return (blocks * (norms / self.levels)[:, None]).view(-1)[:numel]

    def payload_bytes(self, shapes, dtype, world_size):
        blocks = math.ceil(numel(shapes) / self.block_size)
        return numel(shapes) * torch.empty((), dtype=self.int_dtype).element_size() + \
            blocks * torch.empty((), dtype=dtype).element_size()

    def state_dict(self):
        return {"generators": self.rng.state_dict() if self.rng else {}}

    def load_state_dict(self, state):
        if state["generators"]:
            self.rng = _Seeded(self.seed + (dist.get_rank() if dist.is_initialized() else 0))
            self.rng.load_state_dict(state["generators"])

    def __repr__(self):
        return f"QSGD(levels={self.levels}, block_size={self.block_size})"
