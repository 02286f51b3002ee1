"""Uneven inputs: ranks that run out of data keep shadowing the others' collectives.

Built on torch's generic join protocol (`torch.distributed.algorithms.Join`, public): minidp.DDP
is a `JoinableDDP`, so inside `with model.join():`, a rank whose loop has ended waits in
`Join.__exit__`, and for every iteration the other ranks still run, it calls our `main_hook`, which
issues the same collectives a real iteration would, through the same code (`_sync_before_module`:
bucket rebuild, buffer broadcast; then the "do we sync?" vote and, by Reducer.match_joined, one
all-reduce of zeros per bucket).
When the last rank joins, `post_hook` broadcasts the final model from it, since the joined ranks'
optimizers stopped stepping. Same protocol and numerics as torch DDP's join().
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..validate import check_bool
from .collectives import FORWARD, broadcast_coalesced, flat_chunks


def find_common_rank(group, device, candidate: bool) -> int:
    """The highest group rank among those with `candidate` True (DDP's tie-break); a host sync, used once."""
    pick = torch.full((1,), dist.get_rank(group) if candidate else -1, device=device)
    dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=group)  # ranks meet here
    found = int(pick.item())
    if found < 0:
        raise RuntimeError("minidp join: no rank qualified as the authoritative copy")
    return found


def broadcast_from_last_trainer(tensors: list, group, device, training: bool) -> None:
    """Overwrite `tensors` on every rank with those of the highest rank still training, with no host sync.

    DDP learns that rank on the host (`.item()`) before broadcasting from it: a stall on every forward
    under join(). Here each rank finds out on the device whether it is the source, and an all-reduce
    sums the source's values with -0.0 from every other rank (0 for integers): x + (-0.0) == x for
    every float x, signed zeros and NaN included, so all ranks get the source's values bit for bit.

    Args:
        tensors: the buffers to overwrite (any dtypes; grouped into flat chunks by dtype and device).
        device: where the vote runs (the reducer's device).
        training: whether this rank still has data (a candidate to be the source).
    """
    rank = dist.get_rank(group)
    pick = torch.full((1,), rank if training else -1, device=device)
    dist.all_reduce(pick, op=dist.ReduceOp.MAX, group=group)  # ranks meet here: who is the source?
    is_source = pick == rank  # stays on the device
    for chunk in flat_chunks(tensors):  # packed as broadcast_coalesced packs
        flat = torch.cat([t.detach().reshape(-1) for t in chunk])
        summable = flat.to(torch.uint8) if flat.dtype == torch.bool else flat  # sums of bools: as bytes
        neutral = -0.0 if summable.is_floating_point() else 0
        summable = torch.where(is_source.to(flat.device), summable, neutral)
        dist.all_reduce(summable, group=group)  # ranks meet here: the source's values, bit for bit
        with torch.no_grad():
            pieces = summable.to(flat.dtype).split([t.numel() for t in chunk])
            torch._foreach_copy_(chunk, [piece.view_as(t) for piece, t in zip(pieces, chunk)])



class CountedDivisor:
    """join(divide_by_initial_world_size=False): divide by the ranks still training (a buckets.Divisor).

    Counted by an async all-reduce started before the forward (Join.notify_join_context), waited for
    at the first gradient copied, and kept on the device (no .item(), which would wait for the GPU).
    """

    def __init__(self, work):
        self.work = work

    @functools.cached_property
    def value(self) -> torch.Tensor:
        self.work.wait()
        return self.work.result()[0].reshape(())

    @functools.cached_property
    def reciprocal(self) -> torch.Tensor:
        return 1.0 / self.value.double()  # as DDP's reciprocal, in float64


def notify_joined_ranks(ddp) -> CountedDivisor | None:
    """Before a forward under join(): tell the joined ranks (ranks meet here); join()'s divisor, if it sets one.

    No divisor (None) means the reducer divides by the world size.
    """
    count_work = Join.notify_join_context(ddp)  # None outside join()
    if count_work is not None and not ddp.divide_by_initial_world_size:
        return CountedDivisor(count_work)  # divide by the ranks still training
    return None


def vote_to_sync(ddp) -> None:
    """Under join(), after the buffers: a training rank's vote (async), does it sync gradients this
    iteration? Joined ranks learn the result (learn_whether_to_sync)."""
    vote = torch.full((1,), float(ddp.require_backward_grad_sync), device=ddp.join_device)
    dist.all_reduce(vote, group=ddp.process_group, async_op=True)  # ranks meet here


def learn_whether_to_sync(ddp) -> bool:
    """A joined rank's side of vote_to_sync: it votes no and waits for the others' answer."""
    vote = torch.zeros(1, device=ddp.join_device)
    dist.all_reduce(vote, group=ddp.process_group)  # ranks meet here
    return vote.item() != 0


class DDPJoinHook(JoinHook):
    """Shadows one iteration of minidp.DDP per call of main_hook, on a rank that has no more data."""

    def __init__(self, ddp):
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        # Ranks meet here: the same collectives, from the same code, as a training rank's forward.
        ddp.reducer.check_consistency(FORWARD, joined=True)  # debug mode only
        ddp._sync_before_module(joined=True)
        should_sync = learn_whether_to_sync(ddp)  # ranks meet here
        ddp.require_forward_param_sync = should_sync
        if should_sync:
            ddp.reducer.match_joined()  # ranks meet there: one backward's buckets, with zeros

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = find_common_rank(ddp.process_group, ddp.join_device, is_last_joiner)
        states = [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        if ddp.broadcast_buffers:
            states += ddp._buffers_to_sync()
        broadcast_coalesced(states, ddp.process_group, src=src)  # ranks meet here: the final model


class JoinableDDP(Joinable):
    """minidp.DDP's side of the Join protocol (a base class of minidp.DDP): join() and what Join asks of it.

    The wrapper's forward calls the functions above (notify_joined_ranks, vote_to_sync), not these methods.
    """

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """Train on uneven inputs: `with model.join(): for batch in my_batches: ...` (DDP's join()).

        Args:
            divide_by_initial_world_size: average over the initial world size (joined ranks add
                zeros), or over the ranks still training. Default True.
            enable: False turns the context into a no-op. Default True.
            throw_on_early_termination: raise on every rank as soon as one runs out. Default False.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> DDPJoinHook:
        """Called by Join on entering the context: the one place the join settings are set."""
        self.divide_by_initial_world_size = check_bool(
            "divide_by_initial_world_size", kwargs.get("divide_by_initial_world_size", True))
        return DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where join()'s votes run: the module's device (there may be no bucket at world size 1)."""
        return self.device

    @property
    def join_process_group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD
