"""Transports: how bytes move between ranks. torch.distributed (TorchDist) or raw NCCL (cupy_nccl.py).

A transport offers three collectives over its ranks, each started asynchronously and returning a
`torch.futures.Future` that completes when the output may be used; its value is the output tensor
or a one-element list of it (torch's own work futures):

    all_reduce(tensor)           sum over ranks, in place
    all_gather(output, input)    output = the inputs of ranks 0..world_size-1, back to back
    all_to_all(output, input)    chunk r of input goes to rank r; chunk r of output came from rank r

`check_device(device)` raises ValueError when the transport cannot run on tensors of `device`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Transport:
    """The interface every transport implements (see the module docstring)."""

    rank: int
    world_size: int

    def check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        raise NotImplementedError

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        raise NotImplementedError

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        raise NotImplementedError


def _check_group(group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed.ProcessGroup or None")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a minidp.comm transport needs torch.distributed: call minidp.init() first")


class TorchDist(Transport):
    """Collectives through torch.distributed, on a private copy of `group`.

    Why a copy: compression_hook issues its collectives from its own thread (so that multi-round
    methods overlap with backward), while the engine issues its own on the model's group. Two
    threads sharing one group could interleave their calls in a different order on each rank.
    Creating the copy is itself a collective over the whole world: every rank constructs it.

    Args:
        group: the ranks to reduce over (a ProcessGroup). Default None: the world.
    """

    def __init__(self, group=None):
        _check_group(group)
        parent = group if group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(parent))
        ranks = dist.get_process_group_ranks(parent)
        self.group = dist.new_group(ranks, backend=self.backend)  # ranks meet here (every rank of the world)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        # torch 2.14 renamed all_gather_into_tensor; torch 2.11 (and older) only has the old name.
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def check_device(self, device: torch.device) -> None:
        if self.backend == "nccl" and torch.device(device).type != "cuda":
            raise ValueError(f"transport={self!r} cannot reduce tensors on {device}: NCCL needs CUDA tensors "
                             "(use a gloo group for CPU tensors)")

    def all_reduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future()  # ranks meet here

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        return self._gather(output, input, group=self.group, async_op=True).get_future()  # ranks meet here

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.futures.Future:
        work = dist.all_to_all_single(output, input, group=self.group, async_op=True)  # ranks meet here
        return work.get_future()

    def __repr__(self) -> str:
        return f"TorchDist(backend={self.backend!r}, world_size={self.world_size})"


def allreduce_hook(transport, bucket):  # no annotations: torch DDP accepts only its exact ones, or none
    """DDP comm hook: exact average over `transport` (torch's allreduce_hook arithmetic: divide, then sum).

    Example:
        model.register_comm_hook(comm.CupyNccl(), comm.allreduce_hook)   # minidp.DDP or torch DDP
    """
    buffer = bucket.buffer()
    transport.check_device(buffer.device)
    buffer.div_(transport.world_size)
    fut = transport.all_reduce(buffer)  # ranks meet here (async)
    return fut.then(lambda _: buffer)
