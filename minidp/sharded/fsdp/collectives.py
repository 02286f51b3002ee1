"""A unit's two collectives: all-gather its parameters, reduce-scatter its gradients (one each).

Both use one flat buffer for the whole unit, laid out as FSDP2 lays it out, so that gloo and NCCL
see the same buffers and sum every element in the same order (bitwise equal results):
- all-gather: each rank's input is its parameters' padded shards back to back; the output is the
  ranks' inputs back to back, (world, per-rank) as a matrix, and column block k is parameter k's
  rows, rank by rank: copied out into each parameter's gathered storage.
- reduce-scatter: the input is that same matrix built from the full gradients (row r: what rank r
  keeps, each gradient zero-padded to world * its padded shard); the output is this rank's row.
Under HSDP the reduce-scatter runs within a replica (the shard group) and an all-reduce across the
replicas follows (replicas.py). The reduce-scatters started in one backward and not yet finished are
a ReducesInFlight, which the units under one root share.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from minidp.runtime.watchdog import naming_laggards

# what a failed collective's error says the ranks were meeting in (the watchdog's report follows)
GATHER = "minidp.fully_shard's all-gather of a unit's parameters"
REDUCE = "minidp.fully_shard's reduce-scatter of a unit's gradients"


class DefaultComm:
    """The collectives a unit runs unless set_custom_all_gather/reduce_scatter replaced them:
    torch.distributed's, on buffers from torch.empty (FSDP2's AllGather/ReduceScatter contract:
    allocate(size, dtype=, device=), then the call)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class DefaultAllGather(DefaultComm):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class DefaultReduceScatter(DefaultComm):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


class Gather:
    """One unit's all-gather: __init__ starts it (async_op=True: it runs while the caller
    computes), wait() finishes it and writes every rank's padded shard of each ShardedParam into its
    gathered copy. A unit mixing dtypes travels as bytes (one collective, one dtype; as FSDP2).

    Args:
        params: the unit's ShardedParams.
        group, rank, world: the process group the shards are gathered from (the shard group, or
            after an int reshard_after_forward the smaller post-forward group), this rank's place.
        async_op: do not wait here (default False).
        on_done: called once the collective is done (default None), e.g. to end a timeline span.
        comm: the all-gather (default: torch.distributed's; set_custom_all_gather's otherwise).
    """

    def __init__(self, params: list, group, rank: int, world: int, async_op: bool = False,
                 on_done=None, comm=None):
        self.params, self.world, self.on_done = params, world, on_done
        comm = comm or DefaultAllGather()
        inputs = [p.gather_input() for p in params]  # cast to param_dtype here, as FSDP2
        self.as_bytes = len({t.dtype for t in inputs}) > 1
        self.sizes = [t.numel() * (t.element_size() if self.as_bytes else 1) for t in inputs]
        self.per_rank = sum(self.sizes)
        dtype = torch.uint8 if self.as_bytes else inputs[0].dtype
        self.output = comm.allocate((world * self.per_rank,), dtype=dtype,
                                    device=inputs[0].device)
        mine = self.output.narrow(0, rank * self.per_rank, self.per_rank)
        with torch.no_grad():
            torch.cat([t.view(torch.uint8) if self.as_bytes else t for t in inputs], out=mine)
        self.work = None
        if world > 1:  # ranks meet here
            with naming_laggards(GATHER):
                self.work = comm(output_tensor=self.output, input_tensor=mine, group=group,
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
            p.write_gathered(block)


def copy_padded(block: torch.Tensor, flat: torch.Tensor) -> None:
    """`flat` into the (world, n) `block` row after row, the rest zeros: the gradient zero-padded to
    world * n, written in place (no padded copy of each gradient, every step)."""
    full_rows, rest = divmod(flat.numel(), block.shape[1])
    block[:full_rows].copy_(flat[:full_rows * block.shape[1]].view(full_rows, -1))
    if full_rows < block.shape[0]:
        block[full_rows:].zero_()
        block[full_rows, :rest].copy_(flat[full_rows * block.shape[1]:])


def divide_factors(reduce_dtype: torch.dtype, shard_world: int, replicas: int = 1,
                   factor: float | None = None, force_sum: bool = False):
    """(divide before, divide after, reduce-scatter op, all-reduce op) to average gradients over
    shard_world * replicas ranks, or divide by `factor` (set_gradient_divide_factor), as FSDP2.

    fp32 and bf16 cannot overflow a sum of a few ranks: the collectives average (ReduceOp.AVG), with
    no division of their own; a custom factor is a pre-multiplied sum (AVG when it is the shard
    world), the all-reduce then a SUM. Other dtypes (fp16), or force_sum (set_force_sum_reduction
    _for_comms): SUMs, dividing by a power of two <= sqrt(factor) before and by the rest after
    (fp16, to keep the sum in range), or all of it after.
    """
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    ranks = shard_world * replicas
    if not overflow_risk and not force_sum:
        if factor is None:
            if ranks == 1:
                return None, None, ReduceOp.SUM, ReduceOp.SUM
            return None, None, ReduceOp.AVG, ReduceOp.AVG
        op = ReduceOp.AVG if factor == shard_world else ReduceOp.PREMUL_SUM(1 / factor)
        return None, None, op, ReduceOp.SUM
    factor = float(ranks) if factor is None else factor
    if not overflow_risk:
        return None, factor, ReduceOp.SUM, ReduceOp.SUM
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre, ReduceOp.SUM, ReduceOp.SUM


def divide(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


class ReduceScatter:
    """One unit's gradient reduce-scatter: __init__ starts it (async_op=True: it runs while the rest
    of backward computes), wait() finishes it: under HSDP the all-reduce across replicas follows
    (replicas.py), then this rank's rows of the average become the DTensor parameters' .grad (or
    are added to it).

    Args:
        params: the unit's ShardedParams that have a gradient.
        grads: their full gradients (freed once copied into the flat buffer).
        group, world: the shard process group and its size.
        async_op: do not wait for the collective here (default False).
        on_done: called once the collective is done (default None), e.g. to end a timeline span.
        options: the unit's ReduceOptions (divide factor, force sum, comm, hook, replicas).

    The reduction runs in the parameters' reduce_dtype (else the gradients' dtype); the rows are
    cast to the parameters' dtype at the end.
    """

    @torch.no_grad()
    def __init__(self, params: list, grads: list, group, world: int, async_op: bool = False,
                 on_done=None, options=None):
        self.params, self.sizes = params, [p.padded.numel() for p in params]
        self.on_done, self.options = on_done, options or ReduceOptions()
        per_rank = sum(self.sizes)
        reduce_dtype = params[0].reduce_dtype or grads[0].dtype
        replicas = self.options.replicas
        pre, self.post, op, self.all_reduce_op = divide_factors(
            reduce_dtype, world, replicas.size if replicas is not None else 1,
            self.options.divide_factor, self.options.force_sum)
        comm = self.options.reduce_scatter or DefaultReduceScatter()
        # row r: the rows rank r keeps, each gradient zero-padded to world * its padded shard
        self.scatter = comm.allocate((world * per_rank,), dtype=reduce_dtype,
                                     device=grads[0].device).view(world, per_rank)
        for block, p, grad in zip(self.scatter.split(self.sizes, dim=1), params, grads):
            copy_padded(block, p.scatter_input(grad, world))
        divide(self.scatter, pre)
        self.mine = comm.allocate((per_rank,), dtype=reduce_dtype, device=grads[0].device)
        self.work = None
        if world > 1:  # ranks meet here
            with naming_laggards(REDUCE):
                self.work = comm(output_tensor=self.mine, input_tensor=self.scatter.view(-1),
                                 group=group, op=op, async_op=async_op)
        elif self.options.divide_factor is not None:
            self.mine.copy_(self.scatter.view(-1) / self.options.divide_factor)
        else:
            self.mine.copy_(self.scatter.view(-1))
        if not async_op:
            self.wait()

    @torch.no_grad()
    def wait(self) -> None:
        """Finish (idempotent): wait for the collective; under HSDP all-reduce it across the
        replicas (or keep it for a later one); the hook; divide, cast, give each param its rows."""
        if self.mine is None:
            return
        if self.work is not None:
            with naming_laggards(REDUCE):
                self.work.wait()
        if self.on_done is not None:
            self.on_done()
        mine, self.mine, self.scatter = self.mine, None, None
        replicas = self.options.replicas
        if replicas is not None and not replicas.all_reduce(mine, self.all_reduce_op,
                                                            self.options.span):
            return  # set_requires_all_reduce(False): kept, summed into the next one
        if self.options.hook is not None:  # set_all_reduce_hook
            self.options.hook(mine)
        divide(mine, self.post)
        mine = mine.to(self.params[0].padded.dtype)
        for p, rows in zip(self.params, mine.split(self.sizes)):
            p.add_grad(rows[:p.local_numel])


class ReduceOptions:
    """What a unit's reduce-scatter does besides averaging over its shard group (FSDPModule's
    setters; the defaults do nothing more).

    Attributes:
        divide_factor: divide the sum by this instead of the ranks (set_gradient_divide_factor).
        force_sum: reduce with SUM only, dividing apart (set_force_sum_reduction_for_comms).
        reduce_scatter: a custom ReduceScatter comm (set_custom_reduce_scatter), or None.
        hook: called with the reduced tensor before the division (set_all_reduce_hook).
        replicas: HSDP's ReplicaAllReduce (replicas.py), or None.
        span: the unit's timeline span maker (Unit._span), for the all-reduce's span.
    """

    def __init__(self, replicas=None):
        self.span = None
        self.divide_factor: float | None = None
        self.force_sum = False
        self.reduce_scatter = None
        self.hook = None
        self.replicas = replicas


class ReducesInFlight:
    """The reduce-scatters started and not yet waited for, shared by the units of one root: at most
    one by default, as FSDP2 (FSDPCommContext.reduce_scatter_states), since each holds a buffer the
    size of its unit's gradients (set_reduce_scatter_max_input_buffers raises the cap). A unit makes
    room before it starts its own."""

    def __init__(self):
        self.pending: list[ReduceScatter] = []
        self.max_in_flight = 1
        # the root queued its end-of-backward callback, which waits for what is left; False when a
        # backward runs through a unit alone (a chunked loss's head called on a detached chunk):
        # nothing would wait, so each reduce-scatter is waited at once (FSDP2 on CPU: synchronous)
        self.waited_at_end = False

    def add(self, reduce: ReduceScatter) -> None:
        """A reduce-scatter just started (async): wait() finishes it, or the end of backward."""
        self.pending.append(reduce)
        if not self.waited_at_end:
            self.wait()

    def make_room(self) -> None:
        """Finish the oldest reduce-scatters until one more fits under the cap."""
        while len(self.pending) >= self.max_in_flight:
            self.pending.pop(0).wait()

    def wait(self) -> None:
        """Finish every reduce-scatter in flight: their parameters' .grad are set, buffers freed."""
        while self.pending:
            self.pending.pop(0).wait()

    def discard(self) -> None:
        """reset_iter_state: wait for the collectives, keep nothing of them."""
        for reduce in self.pending:
            if reduce.work is not None:
                reduce.work.wait()
            reduce.mine = reduce.scatter = None
        self.pending.clear()
