"""FSDP over tensor parallelism: a parameter that is already a DTensor on a TP mesh (FSDP2's FSDP + TP).

Tensor parallelism (parallelize_module: ColwiseParallel, RowwiseParallel, ...) leaves each rank a
piece of a weight, its local tensor, with placements on the TP mesh (Shard(0), Shard(1), Replicate()).
FSDP2's rule, followed here: FSDP shards that local tensor over the data-parallel mesh exactly as it
shards a plain parameter (same chunks, same padding, same collectives, within the DP groups, where
every rank holds the same TP piece's size), and only the labels change:
  * the shard is a DTensor on the joined mesh (the DP dims, then the TP dims), with the DP placements
    then TP's, and the global shape TP's parameter had. When TP cuts the dim FSDP cuts too, the DP
    placement is _StridedShard(dim, split_factor=TP's shards on that dim): a DP rank's rows are a
    chunk of its TP rank's chunk, not a chunk of the whole (DTensor's full_tensor() then puts the
    pieces back in the right order);
  * gathered over the DP group the local tensor is whole again and becomes a DTensor on the TP mesh
    with TP's placements: the module's forward and backward run as under TP alone;
  * its gradient (a DTensor on the TP mesh) is redistributed to TP's placements if autograd left it
    otherwise (a Partial sum, say), and its local tensor is what the reduce-scatter cuts.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


class TensorParallelLayout:
    """The TP side of one parameter: its TP mesh and placements, and the joined mesh of its shard.

    Args:
        param: the parameter, a DTensor on the TP mesh (one or two mesh dims, as FSDP2 allows).
        dp_mesh: the data-parallel mesh fully_shard was given (1-D, or 2-D for HSDP), a slice of
            the same root mesh as the TP mesh.
        dp_placements: the placements a plain parameter would have on `dp_mesh`.
        shard_dim: the dim FSDP cuts.
    """

    def __init__(self, param: DTensor, dp_mesh: DeviceMesh, dp_placements: tuple, shard_dim: int):
        spec = param._spec
        if len(spec.placements) > 2:  # FSDP2's refusal, word for word
            raise NotImplementedError(f"FSDP only supports 1D TP/EP or 2D EP+TP, not {spec.placements}")
        self.tp_mesh, self.tp_placements = spec.mesh, tuple(spec.placements)
        self.shape, self.stride = spec.tensor_meta.shape, spec.tensor_meta.stride
        self.mesh = DeviceMesh._concatenate([dp_mesh, self.tp_mesh])
        split = spec.num_shards_map[shard_dim]  # how many TP pieces the FSDP dim is already cut in
        fsdp = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        self.placements = (*dp_placements[:-1], fsdp, *self.tp_placements)

    def sharded(self, local: torch.Tensor) -> DTensor:
        """This rank's rows of its TP piece (a shard, or its gradient) as a DTensor on the joined mesh."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=self.shape,
                                  stride=self.stride)

    def gathered(self, local: torch.Tensor) -> DTensor:
        """The whole TP piece, gathered over the DP group, as TP's DTensor (it aliases `local`)."""
        return DTensor.from_local(local, self.tp_mesh, self.tp_placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def local_grad(self, grad: DTensor) -> torch.Tensor:
        """The gradient of the gathered parameter as this rank's TP piece (TP's placements)."""
        if tuple(grad.placements) != self.tp_placements:
            grad = grad.redistribute(placements=self.tp_placements)
        return grad.to_local()
