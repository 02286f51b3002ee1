"""The ranks a unit's parameters live on: sharded across one mesh dim, replicated across another.

A 1-D mesh is plain FSDP: every rank of it holds a shard. A 2-D mesh (replicate, shard) is HSDP
(FSDP2's hybrid sharding): the ranks of one row hold the shards of one full copy, each row is a
replica; a gradient is reduce-scattered within the row, then all-reduced across the rows. An int
reshard_after_forward keeps, between forward and backward, a shard over a smaller group (a few
ranks, e.g. one node's), so that backward gathers within that group only: a mesh of its own.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard


class ShardMesh:
    """The shard group (the mesh's last dim) and, for HSDP, the replicate group (dim 0).

    Args:
        mesh: a 1-D DeviceMesh, or a 2-D one (replicate, shard).
    """

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        shard_dim = mesh.ndim - 1
        self.shard_group = mesh.get_group(shard_dim)
        self.shard_size, self.shard_rank = mesh.size(shard_dim), mesh.get_local_rank(shard_dim)
        self.replicate_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self.replicate_size = mesh.size(0) if mesh.ndim == 2 else 1
        # set_separate_reduce_scatter_group: the reduce-scatter on a group of its own
        self.reduce_scatter_group: dist.ProcessGroup | None = None

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None

    def placements(self, shard_dim: int) -> tuple:
        """A parameter's DTensor placements on this mesh."""
        return (Replicate(), Shard(shard_dim)) if self.is_hsdp else (Shard(shard_dim),)


def check_mesh(mesh: DeviceMesh) -> None:
    """FSDP2's refusals of a mesh, word for word."""
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")


def post_forward_mesh(reshard_after_forward, mesh: ShardMesh) -> ShardMesh | None:
    """Where the parameters live between forward and backward (FSDP2's rule): the shard mesh
    itself (True), nowhere but gathered (False: None), or for an int k (a divisor of the shard
    size) groups of k consecutive ranks: the world viewed as (-1, k), a new mesh whose groups every
    rank creates here (ranks meet here: new process groups)."""
    if not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError("reshard_after_forward should be a bool or an int representing the "
                         f"group size to reshard to, not {reshard_after_forward}")
    size = mesh.shard_size
    if not isinstance(reshard_after_forward, bool):
        if reshard_after_forward < 1 or reshard_after_forward > size or \
                size % reshard_after_forward != 0:
            raise ValueError("If passing reshard_after_forward as an int, it should be a factor "
                             f"of {size}, not {reshard_after_forward}")
        if reshard_after_forward == 1:  # FSDP2 warns once and keeps them gathered
            reshard_after_forward = False
        elif reshard_after_forward == size:
            reshard_after_forward = True
    if reshard_after_forward is True:
        return mesh
    if reshard_after_forward is False:
        return None
    ranks = mesh.mesh.mesh.view(-1, reshard_after_forward)  # HSDP's two dims flattened into rows
    return ShardMesh(DeviceMesh(mesh.mesh.device_type, ranks))
