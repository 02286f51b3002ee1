"""A unit's two collectives: all-gather its parameters, reduce-scatter its gradients (one each).

Both use one flat buffer for the whole unit, laid out as FSDP2 lays it out, so that gloo and NCCL
see the same buffers and sum every element in the same order (bitwise equal results):
- all-gather: each rank's input is its parameters' padded shards back to back; the output is the
  ranks' inputs back to back, (world, per-rank) as a matrix, and column block k is parameter k's
  rows, rank by rank: copied out into each parameter's gathered storage.
- reduce-scatter: the input is that same matrix built from the full gradients (row r: what rank r
  keeps, each gradient zero-padded to world * its padded shard); the output is this rank's row.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp


@torch.no_grad()
def all_gather_unit(params: list, group, rank: int, world: int) -> None:
    """Write every rank's padded shard of each ShardedParam in `params` into its gathered copy."""
    sizes = [p.padded.numel() for p in params]
    dtypes = {p.padded.dtype for p in params}
    # one collective wants one dtype: a unit mixing dtypes travels as bytes (FSDP2 does the same)
    as_bytes = len(dtypes) > 1

    def flat(t):
        return t.reshape(-1).view(torch.uint8) if as_bytes else t.reshape(-1)

    if as_bytes:
        sizes = [n * p.padded.element_size() for n, p in zip(sizes, params)]
    dtype = torch.uint8 if as_bytes else dtypes.pop()
    per_rank = sum(sizes)
    output = torch.empty(world * per_rank, dtype=dtype, device=params[0].padded.device)
    mine = output.narrow(0, rank * per_rank, per_rank)
    torch.cat([flat(p.padded) for p in params], out=mine)
    if world > 1:
        dist.all_gather_single(output, mine, group=group)  # ranks meet here
    for p, block in zip(params, output.view(world, per_rank).split(sizes, dim=1)):
        rows = p.alloc_unsharded()
        (rows.view(torch.uint8).view(world, -1) if as_bytes else rows).copy_(block)


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


@torch.no_grad()
def reduce_scatter_unit(params: list, grads: list, group, world: int) -> None:
    """Average `grads` (the full gradients of `params`) over the ranks; each param gets its rows.

    The rows become the DTensor parameter's .grad (or are added to it, as autograd accumulates).
    """
    sizes = [p.padded.numel() for p in params]
    per_rank = sum(sizes)
    scatter = grads[0].new_empty(world, per_rank)  # row r: the rows rank r keeps
    for block, grad, n in zip(scatter.split(sizes, dim=1), grads, sizes):
        block.copy_(F.pad(grad.reshape(-1), (0, world * n - grad.numel())).view(world, n))
    pre, post, op = divide_factors(scatter.dtype, world)
    if pre is not None and pre != 1:
        scatter.div_(pre)
    mine = scatter.new_empty(per_rank)
    if world > 1:
        dist.reduce_scatter_single(mine, scatter.view(-1), op=op, group=group)  # ranks meet here
    else:
        mine.copy_(scatter.view(-1))
    if post is not None and post != 1:
        mine.div_(post)
    for p, rows in zip(params, mine.split(sizes)):
        p.add_grad(rows[:p.local_numel])
