"""DeMo: each rank keeps its own momentum, sends only its fast components (top-k DCT coefficients).

Peng, Quesnelle, Kingma 2024, "DeMo: Decoupled Momentum Optimization" (arXiv 2411.19870), written
from the authors' reference (github.com/bloc97/DeMo, demo.py). An optimizer that does its own
communication: use it without DDP's gradient all-reduce (under model.no_sync(), or with no
wrapper), and start every rank from the same parameters. Per trainable parameter p, every rank:

    p     *= 1 - lr * weight_decay                   decoupled weight decay
    delta  = compression_decay * delta + lr * grad   this rank's momentum, never averaged
    q      = top-k DCT coefficients of each chunk of delta (k = compression_topk)
    delta -= idct(q)                                 what is sent leaves the momentum
    Q      = every rank's q, all-gathered; a coefficient sent by several ranks is their mean
    p     -= lr * sign(idct(Q))                      the same on every rank

Chunks: p is seen as a matrix (rows = shape[0], columns = the rest; a 1-D tensor is one row) and
each side is cut into blocks of the largest divisor of its length up to compression_chunk; each
h x w block gets the orthonormal 2-D DCT-II, C_h B C_w^T, and top-k is taken over its h*w
coefficients. (The authors' code takes 1-D and 2-D tensors only, and a 1-D one as a single row
is the same; a tensor of more dimensions, a convolution's weight, is taken as (shape[0], the rest).)
The mean of coefficients sent by several ranks is the authors' `scatter_reduce(reduce="mean")`.

Wire: per block, k indices (int16 when h*w <= 32768, else int32; the authors send int64) and k
values in p's dtype; every parameter's payload goes in one all-gather (Channel.all_gather_parts).
Arithmetic as written above (lr * grad, then added; not a fused add with alpha), so a plain
reference reproduces it bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..validate import check_int, check_number
from .exchange import Channel
from .transports import TorchDist


def block_size(n: int, target: int) -> int:
    """The largest divisor of n that is at most target (the authors' _get_smaller_split)."""
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


def dct_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix C (n x n), made in float64: coefficients C x, inverse C^T."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    c[0] /= math.sqrt(2)
    return c.to(dtype=dtype, device=device)


@dataclass
class Chunks:
    """How a parameter is cut into h x w blocks of a rows x cols matrix; each block's DCT."""

    shape: torch.Size
    rows: int
    cols: int
    h: int
    w: int
    k: int  # coefficients sent per block
    c_h: torch.Tensor
    c_w: torch.Tensor

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.h * self.w <= 2**15 else torch.int32

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Coefficients of every block, shape (rows/h, cols/w, h*w)."""
        blocks = x.reshape(self.rows // self.h, self.h, self.cols // self.w, self.w).transpose(1, 2)
        return (self.c_h @ blocks @ self.c_w.T).flatten(2)

    def decode(self, coefficients: torch.Tensor) -> torch.Tensor:
        """The tensor (p's shape) whose blocks have these coefficients: the inverse of encode."""
        blocks = self.c_h.T @ coefficients.unflatten(2, (self.h, self.w)) @ self.c_w
        return blocks.transpose(1, 2).reshape(self.shape)


def chunks_for(p: torch.Tensor, chunk: int, topk: int) -> Chunks:
    """How a tensor like `p` is cut into blocks of sides up to `chunk`, sending `topk` of each.

    p is seen as a matrix: rows = shape[0] (1 for a 0-D or 1-D tensor), columns = the rest.
    """
    rows = p.shape[0] if p.dim() > 1 else 1
    cols = p.numel() // rows
    h, w = block_size(rows, chunk), block_size(cols, chunk)
    c_h, c_w = dct_matrix(h, p.dtype, p.device), dct_matrix(w, p.dtype, p.device)
    return Chunks(p.shape, rows, cols, h, w, min(topk, h * w), c_h, c_w)


class DeMo(torch.optim.Optimizer):
    """Decoupled Momentum Optimization: sign steps from every rank's top-k DCT of its momentum.

    Every rank must construct it (its transport makes a process group) and call step() for the
    same parameters: a missing gradient counts as zero, so the collectives match on every rank.

    Args:
        params: parameters or parameter groups (a group may set its own lr, weight_decay).
        lr: learning rate: scales the gradient into the momentum and the sign step; > 0.
        compression_decay: momentum decay, in [0, 1). Default 0.999.
        compression_topk: coefficients sent per block, >= 1 (at most the block's). Default 32.
        compression_chunk: the longest block side, >= 1. Default 64.
        weight_decay: decoupled weight decay, >= 0. Default 0.0.
        process_group: the ranks to communicate with. Default None: the world.

    Example:
        opt = comm.DeMo(model.parameters(), lr=1e-3)
        with model.no_sync():                 # or a plain module: no gradient all-reduce
            loss_fn(model(x), y).backward()
        opt.step(); opt.zero_grad()
        opt.stats()                           # {"steps", "bytes_sent", "bytes_received", ...}
    """

    def __init__(self, params, lr: float, compression_decay: float = 0.999,
                 compression_topk: int = 32, compression_chunk: int = 64,
                 weight_decay: float = 0.0, process_group=None):
        check_number("lr", lr, positive=True)
        check_number("weight_decay", weight_decay, low=0.0)
        self.decay = check_number("compression_decay", compression_decay, low=0.0)
        if not self.decay < 1:
            raise ValueError(f"compression_decay={compression_decay!r} must be < 1 "
                             "(the authors' bound)")
        self.topk = check_int("compression_topk", compression_topk, low=1)
        self.chunk = check_int("compression_chunk", compression_chunk, low=1)
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.channel = Channel(TorchDist(process_group))  # ranks meet here (a private group)
        self.steps, self.bytes_received, self.bytes_dense = 0, 0, 0
        self._chunks: dict = {}  # (shape, dtype, device) -> Chunks

    def chunks_of(self, p: torch.Tensor) -> Chunks:
        """How `p` is cut into blocks (made once per shape, dtype and device)."""
        key = (p.shape, p.dtype, p.device)
        if key not in self._chunks:
            self._chunks[key] = chunks_for(p, self.chunk, self.topk)
        return self._chunks[key]

    @torch.no_grad()
    def step(self, closure=None):
        """One DeMo step on every trainable parameter (one all-gather; every rank must call it)."""
        loss = None if closure is None else torch.enable_grad()(closure)()  # as torch's optimizers
        sent = [(p, group["lr"], *self._compress(p, group)) for group in self.param_groups
                for p in group["params"] if p.requires_grad and p.numel() > 0]
        if not sent:
            return loss
        self.steps += 1
        before = self.channel.bytes_sent
        payload = [part for _, _, chunks, idx, val in sent
                   for part in (idx.to(chunks.index_dtype), val)]
        gathered = self.channel.all_gather_parts(payload)  # ranks meet here: every rank's payload
        world_size = self.channel.transport.world_size
        self.bytes_received += world_size * (self.channel.bytes_sent - before)
        for i, (p, lr, chunks, _, val) in enumerate(sent):
            every_idx = torch.cat([parts[2 * i].long() for parts in gathered], dim=-1)  # rank order
            every_val = torch.cat([parts[2 * i + 1] for parts in gathered], dim=-1)
            mean = val.new_zeros((*val.shape[:-1], chunks.h * chunks.w))
            mean.scatter_reduce_(-1, every_idx, every_val, reduce="mean", include_self=False)
            p.add_(chunks.decode(mean).sign_(), alpha=-lr)  # lr * sign is exact: no rounding here
            self.bytes_dense += p.numel() * p.element_size()
        return loss

    def _compress(self, p: torch.Tensor, group: dict):
        """Decay p, update its momentum, take its top-k out: (chunks, indices, values)."""
        lr, state = group["lr"], self.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        delta = state["delta"]
        if group["weight_decay"] != 0:
            p.mul_(1 - lr * group["weight_decay"])
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        delta.mul_(self.decay).add_(lr * grad)
        chunks = self.chunks_of(p)
        coefficients = chunks.encode(delta)
        idx = coefficients.abs().topk(chunks.k, dim=-1, sorted=False).indices
        val = coefficients.gather(-1, idx)
        delta.sub_(chunks.decode(torch.zeros_like(coefficients).scatter_(-1, idx, val)))
        return chunks, idx, val

    def stats(self) -> dict:
        """This rank since the start: steps, bytes sent, received, and DDP's all-reduce would send.

        bytes_received counts the all-gather's whole output (this rank's own part too, as the
        authors' data_receive does): world_size times bytes_sent.
        """
        sent, dense = self.channel.bytes_sent, self.bytes_dense
        return {"steps": self.steps, "bytes_sent": sent, "bytes_received": self.bytes_received,
                "bytes_dense": dense, "ratio": sent / dense if dense else 0.0}

    def state_dict(self) -> dict:
        """torch's optimizer state (each parameter's momentum `delta`), steps, byte counters."""
        state = super().state_dict()
        state["demo"] = {"steps": self.steps, "bytes_sent": self.channel.bytes_sent,
                         "bytes_received": self.bytes_received, "bytes_dense": self.bytes_dense}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned on this rank (momenta differ from rank to rank)."""
        state_dict = dict(state_dict)
        counters = state_dict.pop("demo")
        super().load_state_dict(state_dict)
        self.steps, self.channel.bytes_sent = counters["steps"], counters["bytes_sent"]
        self.bytes_received, self.bytes_dense = counters["bytes_received"], counters["bytes_dense"]
