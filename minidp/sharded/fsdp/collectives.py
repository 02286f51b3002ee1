"""A unit's two collectives: all-gather its parameters, reduce-scatter its gradients (one each).

Both use one flat buffer for the whole unit, laid out as FSDP2 lays it out, so that gloo and NCCL
see the same buffers and sum every element in the same order (bitwise equal results):
- all-gather: each rank's input is its parameters' padded shards back to back; the output is the
  ranks' inputs back to back, (world, per-rank) as a matrix, and column block k is parameter k's
  rows, rank by rank: copied out into each parameter's gathered storage.
- reduce-scatter: the input is that same matrix built from the full gradients (row r: what rank r
  keeps, each gradient zero-padded to world * its padded shard); the output is this rank's row.
The reduce-scatters started in one backward and not yet finished are a ReducesInFlight, which the
units under one root share.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from minidp.runtime.watchdog import naming_laggards

# what a failed collective's error says the ranks were meeting in (the watchdog's report follows)
GATHER = "minidp.fully_shard's all-gather of a unit's parameters"
REDUCE = "minidp.fully_shard's reduce-scatter of a unit's gradients"


class Gather:
    """One unit's all-gather: __init__ starts it (async_op=True: it runs while the caller
    computes), wait() finishes it and writes every rank's padded shard of each ShardedParam into its
    gathered copy. A unit mixing dtypes travels as bytes (one collective, one dtype; as FSDP2).
    on_done (default None) is called once the collective is done, e.g. to end a timeline span."""

    def __init__(self, params: list, group, rank: int, world: int, async_op: bool = False,
                 on_done=None):
        self.params, self.world, self.on_done = params, world, on_done
        inputs = [p.gather_input() for p in params]  # cast to param_dtype here, as FSDP2
        self.as_bytes = len({t.dtype for t in inputs}) > 1
        self.sizes = [t.numel() * (t.element_size() if self.as_bytes else 1) for t in inputs]
        self.per_rank = sum(self.sizes)
        dtype = torch.uint8 if self.as_bytes else inputs[0].dtype
        self.output = torch.empty(world * self.per_rank, dtype=dtype, device=inputs[0].device)
        mine = self.output.narrow(0, rank * self.per_rank, self.per_rank)
        with torch.no_grad():
            torch.cat([t.view(torch.uint8) if self.as_bytes else t for t in inputs], out=mine)
        self.work = None
        if world > 1:  # ranks meet here
            with naming_laggards(GATHER):
                self.work = dist.all_gather_single(self.output, mine, group=group,
                                                   async_op=async_op)

    @torch.no_grad()
    def wait(self, copy_out: bool = True) -> None:
        """Wait for the collective, then (copy_out=True) write the gathered copies."""
        if self.work is not None:
            with naming_laggards(GATHER):
                self.work.wait()
        if self.on_done is not None:
            self.on_done()
        if not copy_out:
            return
        rows = self.output.view(self.world, self.per_rank).split(self.sizes, dim=1)
        for p, block in zip(self.params, rows):
            full = p.alloc_unsharded()
            (full.view(torch.uint8).view(self.world, -1) if self.as_bytes else full).copy_(block)


def copy_padded(block: torch.Tensor, flat: torch.Tensor) -> None:
    """`flat` into the (world, n) `block` row after row, the rest zeros: the gradient zero-padded to
    world * n, written in place (no padded copy of each gradient, every step)."""
    full_rows, rest = divmod(flat.numel(), block.shape[1])
    block[:full_rows].copy_(flat[:full_rows * block.shape[1]].view(full_rows, -1))
    if full_rows < block.shape[0]:
        block[full_rows:].zero_()
        block[full_rows, :rest].copy_(flat[full_rows * block.shape[1]:])


def divide_factors(reduce_dtype: torch.dtype, world: int):
    """(divide before, divide after, reduce op) to average gradients over `world` ranks, as FSDP2.

    fp32 and bf16 cannot overflow a sum of a few ranks: the collective averages (ReduceOp.AVG), with
    no division of its own. Other dtypes (fp16) divide by a power of two <= sqrt(world) before a SUM
    and by the rest after, to keep the sum in range. One rank: nothing to do.
    """
    if world == 1:
        return None, None, ReduceOp.SUM
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, None, ReduceOp.AVG
    pre = 1
    while world % pre == 0 and world / pre > pre:
        pre *= 2
    return pre, world / pre, ReduceOp.SUM


class ReduceScatter:
    """One unit's gradient reduce-scatter: __init__ starts it (async_op=True: it runs while the rest
    of backward computes), wait() finishes it: this rank's rows of the average become the DTensor
    parameters' .grad (or are added to it).

    Args:
        params: the unit's ShardedParams that have a gradient.
        grads: their full gradients (freed once copied into the flat buffer).
        group, world: the process group and its size.
        async_op: do not wait for the collective here (default False).
        on_done: called once the collective is done (default None), e.g. to end a timeline span.

    The reduction runs in the parameters' reduce_dtype (else the gradients' dtype); the rows are
    cast to the parameters' dtype at the end.
    """

    @torch.no_grad()
    def __init__(self, params: list, grads: list, group, world: int, async_op: bool = False,
                 on_done=None):
        self.params, self.sizes = params, [p.padded.numel() for p in params]
        self.on_done = on_done
        per_rank = sum(self.sizes)
        reduce_dtype = params[0].reduce_dtype or grads[0].dtype
        # row r: the rows rank r keeps, each gradient zero-padded to world * its padded shard
        self.scatter = grads[0].new_empty(world, per_rank, dtype=reduce_dtype)
        for block, grad in zip(self.scatter.split(self.sizes, dim=1), grads):
            copy_padded(block, grad.reshape(-1))
        pre, self.post, op = divide_factors(reduce_dtype, world)
        if pre is not None and pre != 1:
            self.scatter.div_(pre)
        self.mine = self.scatter.new_empty(per_rank)
        self.work = None
        if world > 1:  # ranks meet here
            with naming_laggards(REDUCE):
                self.work = dist.reduce_scatter_single(self.mine, self.scatter.view(-1), op=op,
                                                       group=group, async_op=async_op)
        else:
            self.mine.copy_(self.scatter.view(-1))
        if not async_op:
            self.wait()

    @torch.no_grad()
    def wait(self) -> None:
        """Finish (idempotent): wait for the collective, divide, cast, give each param its rows."""
        if self.mine is None:
            return
        if self.work is not None:
            with naming_laggards(REDUCE):
                self.work.wait()
        if self.on_done is not None:
            self.on_done()
        mine, self.mine, self.scatter = self.mine, None, None
        if self.post is not None and self.post != 1:
            mine.div_(self.post)
        mine = mine.to(self.params[0].padded.dtype)
        for p, rows in zip(self.params, mine.split(self.sizes)):
            p.add_grad(rows[:p.local_numel])


class ReducesInFlight:
    """The reduce-scatters started and not yet waited for, shared by the units of one root: at most
    one, as FSDP2 by default (FSDPCommContext.reduce_scatter_states), since each holds a buffer the
    size of its unit's gradients. A unit waits for the previous one before it starts its own."""

    def __init__(self):
        self.pending: list[ReduceScatter] = []

    def add(self, reduce: ReduceScatter) -> None:
        """A reduce-scatter just started (async): wait() finishes it."""
        self.pending.append(reduce)

    def wait(self) -> None:
        """Finish every reduce-scatter in flight: their parameters' .grad are set, buffers freed."""
        while self.pending:
            self.pending.pop(0).wait()
