"""The two kinds of compression method: Compressor (one round, minidp.comm runs the exchange) and MultiRound.

A **Compressor** turns a flat bucket into a payload (a list of tensors) and back; the hook runs the
exchange (exchange.single_round). If payloads can be summed element by element (`summable = True`:
casts, or values at positions every rank shares), each part is divided by the world size and
all-reduced. Otherwise (top-k's own indices, QSGD's per-rank norms) every rank's payload is
all-gathered, decompressed and summed in rank order, so every rank computes the same bits:

    class Half(comm.Compressor):
        summable = True
        def compress(self, tensor, ctx):       return [tensor.half()]
        def decompress(self, payload, ctx):    return payload[0].to(ctx.dtype)
        def payload_bytes(self, ctx):          return 2 * ctx.numel      # optional: a cross-check

A **MultiRound** method runs its own collectives over the Channel, one round after another (Sign's
worker then server stage, PowerSGD's P then Q): it implements reduce(job, channel).

Both get a Context (context.py): rank, world size, step, the bucket's shapes, dtype and device, and
a private generator seeded from `seed` (and the rank, unless `shared_seed`). The Channel counts the
bytes; `payload_bytes(ctx)`, if a method defines it, is checked against that count bucket by bucket.
"""
from __future__ import annotations

import abc

import torch

from .context import Context
from .exchange import Channel, Job


class _Method:
    """What both kinds share: the seed of ctx.generator, the input check, the optional byte formula, state."""

    seed = 0  # ctx.generator's seed (plus the rank unless shared_seed); set it in __init__ to make it an argument
    shared_seed = False  # True: every rank's generator draws the same numbers (e.g. positions every rank uses)

    def check(self, tensor: torch.Tensor) -> None:
        """Raise TypeError if this method cannot take `tensor` (by default: not floating point)."""
        if not tensor.is_floating_point():
            raise TypeError(f"compressor={self!r} needs a floating-point bucket, got dtype {tensor.dtype}")

    def payload_bytes(self, ctx: Context) -> int | None:
        """Bytes this rank hands to collectives for the bucket `ctx` describes, or None (default: not declared).

        When declared, the hook checks it against what the Channel counted, bucket by bucket, and
        raises RuntimeError if they differ.
        """
        return None

    def state_dict(self) -> dict:
        """What the method keeps between steps (tensors and plain values); saved with the hook's state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what state_dict() returned (on the same rank)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Compressor(_Method, abc.ABC):
    """A single-round compressor: compress and decompress; minidp.comm runs the exchange (see the module docstring)."""

    summable = False  # True: payloads of all ranks can be summed part by part (then all-reduced)

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor, ctx: Context) -> list[torch.Tensor]:
        """The payload: the tensors to send for this flat bucket (the same shapes and dtypes on every rank)."""

    @abc.abstractmethod
    def decompress(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        """A flat tensor of ctx.numel elements in ctx.dtype, from one payload (or the sum of summable ones)."""

    def aggregate(self, payloads: list[list[torch.Tensor]], ctx: Context) -> torch.Tensor:
        """The sum of every rank's decompressed payload, in rank order (the same bits on every rank)."""
        total = self.decompress(payloads[0], ctx).clone()
        for payload in payloads[1:]:
            total.add_(self.decompress(payload, ctx))
        return total


class MultiRound(_Method, abc.ABC):
    """A method that runs its own exchange of one or more rounds over the channel (Sign, PowerSGD).

    Every rank must issue the same collectives in the same order: they run on the hook's worker
    thread, one bucket after another.
    """

    @abc.abstractmethod
    def reduce(self, job: Job, channel: Channel) -> torch.Tensor | None:
        """Average job.tensor over ranks in place; return the residual (meant minus sent) if job.with_memory.

        Args:
            job: the bucket (tensor, per-parameter keys and sizes, with_memory) and its Context (job.ctx).
            channel: the transport, counting bytes: all_reduce, all_gather, all_to_all, all_gather_parts.
        """
