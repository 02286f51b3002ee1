"""HSDP's second reduction: after the reduce-scatter within a replica, an all-reduce across them.

On a 2-D mesh (replicate, shard) each replica (a row of the mesh) holds one full copy of the
parameters, sharded over its ranks; the rank holding shard k of one replica holds shard k of every
other. So a gradient is reduce-scattered within the replica (each rank gets the sum of its rows
over the replica), then all-reduced across the replicas among the ranks that hold the same rows
(a column of the mesh). FSDP2 averages in both collectives (ReduceOp.AVG, fp32/bf16), so the result
is the mean of the replicas' means.

set_requires_all_reduce(False) (gradient accumulation over micro-batches) reduce-scatters every
micro-batch but keeps the result here, summed, and all-reduces the sum with the next micro-batch
that asks for it: one all-reduce per step instead of one per micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minidp.runtime.watchdog import naming_laggards

ALL_REDUCE = "minidp.fully_shard's all-reduce of a unit's gradients across HSDP replicas"
ALL_REDUCE_LANE = "fully_shard all-reduce"  # its lane in the unit's timeline


class ReplicaAllReduce:
    """One unit's all-reduce across replicas, and the reduce-scatter outputs it keeps meanwhile.

    Args:
        group: the replicate process group (the mesh's dim 0, this rank's column).
        size: its size (the number of replicas).
    """

    def __init__(self, group, size: int):
        self.group, self.size = group, size
        self.requires_all_reduce = True  # set_requires_all_reduce
        self.partial: torch.Tensor | None = None  # reduce-scatter outputs not all-reduced yet

    @torch.no_grad()
    def all_reduce(self, reduced: torch.Tensor, op, span=None) -> bool:
        """All-reduce `reduced` (this unit's reduce-scatter output) in place, the kept sum added
        first; or, while all-reduce is off, add it to the kept sum. True if it was all-reduced.
        span (default None): the unit's timeline span maker (Unit._span), while one records."""
        if not self.requires_all_reduce:
            self.partial = reduced if self.partial is None else self.partial.add_(reduced)
            return False
        if self.partial is not None:
            reduced += self.partial
            self.partial = None
        end = span(ALL_REDUCE_LANE) if span is not None else None
        with naming_laggards(ALL_REDUCE):  # ranks meet here (one column of the mesh)
            dist.all_reduce(reduced, op=op, group=self.group)
        if end is not None:
            end()
        return True

    def discard(self) -> None:
        """reset_iter_state: the kept sum belongs to a failed step."""
        self.partial = None
