"""One parameter under fully_shard: its dim-0 shard on this rank (a DTensor) and its gathered copy.

The layout is FSDP2's, so that torch's optimizers, clip_grad_norm_ and state dicts see the same
tensors: the parameter is cut along dim 0 as torch.chunk cuts it (ceil(rows / world) rows a rank;
the last ranks may get fewer, or none), each rank stores its rows zero-padded to the first chunk's
size (`padded`, so that every rank sends the same number of elements to the all-gather), and the
DTensor's local tensor is the unpadded rows: a view of `padded`, so an optimizer step on the DTensor
updates what the next all-gather sends.

The gathered copy (`unsharded`) is one nn.Parameter for the module's life, as in FSDP2: autograd
saves it in forward and accumulates its .grad in backward. Resharding frees its memory by shrinking
its storage to 0 bytes; unsharding grows the storage back and writes the gathered values into it
through `full`, a second tensor on the same storage with its own version counter (so the tensors
autograd saved in forward read the new values without a "modified by an inplace operation" error).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def contiguous_strides(size) -> tuple:
    """The strides of a contiguous tensor of `size`."""
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class ShardedParam:
    """A parameter's shard on this rank, its padding, and its gathered copy.

    Args:
        param: the module's original parameter (any device; moved to `device`).
        places: every (module, attribute name) the parameter is registered under (tied weights:
            several), where the sharded or the gathered parameter is put in its place.
        mesh: a 1-D DeviceMesh over the ranks that share the parameter.
        device: where the shard lives.
    """

    def __init__(self, param: nn.Parameter, places: list, mesh, device: torch.device):
        self.places, self.mesh = places, mesh
        world, rank = mesh.size(), mesh.get_local_rank()
        data = param.detach().to(device)
        self.size, self.stride = data.size(), contiguous_strides(data.size())
        chunks = torch.chunk(data, world, dim=0)  # fewer than `world` chunks when rows < world
        own = chunks[rank] if rank < len(chunks) else data[:0]
        self.padded = data.new_zeros(chunks[0].size())  # this rank's rows, then zeros
        self.padded[:own.size(0)].copy_(own)
        self.sharded_size, self.local_numel = own.size(), own.numel()
        self.sharded = nn.Parameter(self.as_dtensor(self.padded[:own.size(0)]),
                                    requires_grad=param.requires_grad)
        self.full: torch.Tensor | None = None  # the gathered rows, padding included (flat)
        self.unsharded: nn.Parameter | None = None
        self.set_on_modules(self.sharded)

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows of the parameter or of its gradient) as a DTensor like it."""
        with torch.no_grad():
            return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False,
                                      shape=self.size, stride=self.stride)

    def set_on_modules(self, param: nn.Parameter) -> None:
        """Register `param` under every name the original parameter had (no checks, as FSDP2)."""
        for module, name in self.places:
            if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
                module._parameters[name] = param
            else:  # a module with its own __setattr__ sees the change
                setattr(module, name, param)

    def alloc_unsharded(self) -> torch.Tensor:
        """Memory for the gathered rows (made once, then regrown), as (world, padded shard)."""
        world = self.mesh.size()
        numel = world * self.padded.numel()
        if self.full is None:
            storage = torch.empty(numel, dtype=self.padded.dtype, device=self.padded.device)
            storage = storage.untyped_storage()
            self.full = self.padded.new_empty(0).set_(storage, 0, (numel,), (1,))
            view = self.padded.new_empty(0).set_(storage, 0, self.size, self.stride)
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
        elif self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(numel * self.full.element_size())
        return self.full.view(world, -1)

    def to_unsharded(self) -> None:
        """Put the gathered parameter in the module (after its rows were written)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.set_on_modules(self.unsharded)

    def to_sharded(self) -> None:
        """Put the sharded DTensor back in the module and free the gathered rows' memory."""
        self.set_on_modules(self.sharded)
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    def take_grad(self) -> torch.Tensor | None:
        """The gathered parameter's gradient (unsharded), removed from it; None if it has none."""
        if self.unsharded is None or self.unsharded.grad is None:
            return None
        grad, self.unsharded.grad = self.unsharded.grad, None
        return grad

    def add_grad(self, rows: torch.Tensor) -> None:
        """Make `rows` (this rank's rows of the reduced gradient) the DTensor's .grad, or add."""
        rows = rows.view(self.sharded_size)
        if self.sharded.grad is None:
            self.sharded.grad = self.as_dtensor(rows)
        else:
            with torch.no_grad():
                self.sharded.grad.to_local().add_(rows)
