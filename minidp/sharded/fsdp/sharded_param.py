"""One parameter under fully_shard: its shard on this rank (a DTensor) and its gathered copy.

The layout is FSDP2's, so that torch's optimizers, clip_grad_norm_ and state dicts see the same
tensors: the parameter is cut along dim 0 as torch.chunk cuts it (ceil(rows / world) rows a rank;
the last ranks may get fewer, or none), each rank stores its rows zero-padded to the first chunk's
size (`padded`, so that every rank sends the same number of elements to the all-gather), and the
DTensor's local tensor is the unpadded rows: a view of `padded`, so an optimizer step on the DTensor
updates what the next all-gather sends. A shard_placement_fn may cut another dim (Shard(1), ...):
then the cut must be even (FSDP2's rule), the gather puts the chunks back side by side along that
dim, and the gradient's chunks are stacked along dim 0 before the reduce-scatter. Under HSDP the
world here is the shard group (the mesh's last dim); the DTensor is (Replicate(), Shard(dim)).
With CPU offload the shard (and its gradient) stays on the CPU; the gather input is copied to the
device. A parameter that is already a DTensor (tensor parallelism's) is sharded the same way, its
local tensor standing for the parameter; tensor_parallel.py says what changes (only the labels).

The gathered copy (`unsharded`) is one nn.Parameter for the module's life, as in FSDP2: autograd
saves it in forward and accumulates its .grad in backward. Resharding frees its memory by shrinking
its storage to 0 bytes; unsharding grows the storage back and writes the gathered values into it
through `full`, a second tensor on the same storage with its own version counter (so the tensors
autograd saved in forward read the new values without a "modified by an inplace operation" error).

The module's original parameter is replaced, not changed: an optimizer built before fully_shard
would go on stepping it, a tensor no forward reads any more, and train nothing without a word.
Each replaced parameter is marked, and one optimizer step pre-hook (torch's, global to every
optimizer, registered at the first fully_shard) raises at such an optimizer's first step.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .tensor_parallel import TensorParallelLayout

REPLACED = "_minidp_replaced_by_fully_shard"  # marks an original parameter: where it was
ORIGINAL_UID = "_minidp_fully_shard_uid"  # on an original parameter: its number, for tied weights
_uids = itertools.count()
# torch's optimizer hooks are global: one registration serves every fully_shard (never removed)
_step_check = None


def mark_replaced(param: nn.Parameter, places: list) -> None:
    """Mark `param` as replaced by its shard, and make sure optimizers are checked for it."""
    global _step_check
    module, name = places[0]
    param.__dict__[REPLACED] = f"{type(module).__name__}.{name} {tuple(param.shape)}"
    if _step_check is None:
        _step_check = register_optimizer_step_pre_hook(check_optimizer)


def check_optimizer(optimizer, args, kwargs) -> None:
    """An optimizer step pre-hook: refuse to step parameters that fully_shard replaced."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            where = param.__dict__.get(REPLACED)
            if where is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameters that minidp.fully_shard has "
                    f"replaced by their shards (e.g. {where}): its step would update tensors no "
                    "forward reads. Build the optimizer after fully_shard(...), from "
                    "model.parameters()")


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
        mesh: the unit's ShardMesh (shards over its shard group).
        device: where the gathered copy and the collectives live.
        mp_policy: torch's MixedPrecisionPolicy: param_dtype is the gathered copy's dtype (the
            shard keeps the parameter's), reduce_dtype the gradients' in the reduce-scatter.
        shard_dim: the dim cut into shards (default 0; shard_placement_fn's Shard(dim)).
        offload: keep the shard and its gradient on the CPU (CPUOffloadPolicy).
        pin_memory: pin the CPU shard (CPUOffloadPolicy.pin_memory; needs CUDA, as in FSDP2).
    """

    def __init__(self, param: nn.Parameter, places: list, mesh, device: torch.device, mp_policy,
                 shard_dim: int = 0, offload: bool = False, pin_memory: bool = False):
        self.places, self.mesh, self.device = places, mesh, device
        self.offload, self.pin_memory = offload, offload and pin_memory
        # who the original parameter was: a weight tied across two fully_shard calls has one uid
        # in two units (the root's first forward refuses it, as FSDP2)
        self.uid = param.__dict__.setdefault(ORIGINAL_UID, next(_uids))
        world, rank = mesh.shard_size, mesh.shard_rank
        if not param.is_contiguous():  # FSDP2's refusal, word for word
            raise NotImplementedError("FSDP does not support non-contiguous parameters yet: "
                                      f"{param.shape=} {param.stride()=}")
        self.shard_dim = shard_dim + param.dim() if shard_dim < 0 else shard_dim
        if self.shard_dim >= param.dim():
            raise AssertionError(f"Shard dim {self.shard_dim} is invalid for {param.dim()}D "
                                 f"tensor: {param.shape}")
        # tensor parallelism's DTensor: its local tensor (this TP rank's piece) is what is sharded
        self.tp = TensorParallelLayout(param, mesh.mesh, mesh.placements(self.shard_dim), self.shard_dim) \
            if isinstance(param, DTensor) else None
        if self.tp is not None:
            param = param.to_local()
        if self.shard_dim > 0 and param.size(self.shard_dim) % world != 0:
            raise NotImplementedError(f"FSDP does not support uneven sharding on dim "
                                      f"{self.shard_dim}: {param.size()} (world size: {world})")
        home = torch.device("cpu") if offload else device
        # a meta parameter stays meta (deferred init: to_empty() then an init or a load; reset())
        data = param.detach() if param.is_meta else param.detach().to(home)
        self.size, self.stride = data.size(), contiguous_strides(data.size())
        chunks = torch.chunk(data, world, dim=self.shard_dim)  # fewer when rows < world
        own = chunks[rank] if rank < len(chunks) else data.narrow(self.shard_dim, 0, 0)
        self.padded = data.new_zeros(chunks[0].size())  # this rank's rows, then zeros
        self.padded.narrow(self.shard_dim, 0, own.size(self.shard_dim)).copy_(own)
        if self.pin_memory and not self.padded.is_meta:
            self.padded = self.padded.pin_memory()
        self.sharded_size, self.local_numel = own.size(), own.numel()
        self.sharded = nn.Parameter(self.as_dtensor(self._local_view(self.padded)),
                                    requires_grad=param.requires_grad)
        self.full: torch.Tensor | None = None  # the gathered rows, padding included (flat)
        self.unsharded: nn.Parameter | None = None
        self.post_forward: torch.Tensor | None = None  # an int reshard_after_forward's slice
        self.set_on_modules(self.sharded)
        mark_replaced(param, places)
        # FSDP2's clamps: no reduce cast when it equals param_dtype, no cast of a non-float param
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = None if mp_policy.reduce_dtype == self.param_dtype \
            else mp_policy.reduce_dtype
        self.accumulated: torch.Tensor | None = None  # gradients kept across unsynced backwards

    def _local_view(self, padded: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `padded` (its padding cut off): the DTensor's local tensor."""
        return padded.narrow(self.shard_dim, 0, self.sharded_size[self.shard_dim])

    def reset(self) -> None:
        """Adopt the module's parameter if something replaced it or its local tensor (to_empty(),
        .to(), load_state_dict(assign=True): FSDP2's reset_sharded_param): its rows are copied into
        a new padded shard, and the parameter (the same Python object, which an optimizer may
        hold) becomes a DTensor viewing that shard."""
        module, name = self.places[0]
        current = module._parameters[name]
        with torch.no_grad():
            local = current.to_local()
        if local.is_meta or (current is self.sharded and self.padded.device == local.device
                             and local.untyped_storage().data_ptr()
                             == self.padded.untyped_storage().data_ptr()):
            return  # not materialized yet, or still our view of the padded shard
        self.padded = local.new_zeros(self.padded.size())
        self.padded.narrow(self.shard_dim, 0, local.size(self.shard_dim)).copy_(local)
        if self.pin_memory and not self.padded.is_pinned():
            self.padded = self.padded.pin_memory()
        new = nn.Parameter(self.as_dtensor(self._local_view(self.padded)),
                           requires_grad=current.requires_grad)
        torch.utils.swap_tensors(current, new)  # the same object: an optimizer may hold it
        self.sharded = current
        self.full = self.unsharded = None  # made again, on the shard's device, at the next gather
        self.set_on_modules(self.sharded)

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """`local` (this rank's rows of the parameter or of its gradient) as a DTensor like it."""
        with torch.no_grad():
            if self.tp is not None:
                return self.tp.sharded(local)
            return DTensor.from_local(local, self.mesh.mesh, self.mesh.placements(self.shard_dim),
                                      run_check=False, shape=self.size, stride=self.stride)

    def set_on_modules(self, param: nn.Parameter) -> None:
        """Register `param` under every name the original parameter had (no checks, as FSDP2)."""
        for module, name in self.places:
            if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
                module._parameters[name] = param
            else:  # a module with its own __setattr__ sees the change
                setattr(module, name, param)

    def alloc_unsharded(self) -> torch.Tensor:
        """Memory for the gathered parameter (made once, then regrown): `full`, flat."""
        numel = self.mesh.shard_size * self.padded.numel()
        if self.full is None:
            empty = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            storage = torch.empty(numel, dtype=self.compute_dtype, device=self.device)
            storage = storage.untyped_storage()
            self.full = empty.clone().set_(storage, 0, (numel,), (1,))
            view = empty.clone().set_(storage, 0, self.size, self.stride)
            if self.tp is not None:  # the whole TP piece, labelled as TP's DTensor
                with torch.no_grad():
                    view = self.tp.gathered(view)
            self.unsharded = nn.Parameter(view, requires_grad=self.sharded.requires_grad)
        elif self.full.untyped_storage().size() == 0:
            self.full.untyped_storage().resize_(numel * self.full.element_size())
        return self.full

    @torch.no_grad()
    def write_gathered(self, rows: torch.Tensor) -> None:
        """Write the gathered copy from `rows`, (world, per rank) as the all-gather returned it
        (bytes when the unit mixes dtypes). Rank r's rows are its dim-0 chunk (or, after an int
        reshard_after_forward, its slice of the flat copy): stacked, they are the parameter; a
        Shard(dim > 0) parameter's chunks go side by side along that dim instead."""
        full = self.alloc_unsharded()
        stacked = self.shard_dim == 0 or self.post_forward is not None
        if rows.dtype != full.dtype:  # a unit of mixed dtypes travelled as bytes
            if stacked:
                full.view(torch.uint8).view(rows.shape[0], -1).copy_(rows)
                return
            rows = rows.contiguous().view(full.dtype)
        if stacked:
            full.view(rows.shape[0], -1).copy_(rows)
            return
        chunks = [row.view(self.padded.shape) for row in rows]
        torch.cat(chunks, dim=self.shard_dim, out=full.view(self.size))

    def to_unsharded(self) -> None:
        """Put the gathered parameter in the module (after its rows were written)."""
        if self.unsharded.requires_grad != self.sharded.requires_grad:
            self.unsharded.requires_grad_(self.sharded.requires_grad)
        self.set_on_modules(self.unsharded)
        self.post_forward = None

    def to_sharded(self) -> None:
        """Put the sharded DTensor back in the module and free the gathered rows' memory."""
        self.set_on_modules(self.sharded)
        self.post_forward = None
        if self.full is not None:
            self.full.untyped_storage().resize_(0)

    @torch.no_grad()
    def to_post_forward(self, post) -> None:
        """An int reshard_after_forward: keep this rank's slice of the flat gathered copy for
        the `post` mesh's group (a copy: the gathered memory is freed) and register it as a
        DTensor on that mesh (FSDP2's sharded post-forward parameter)."""
        if self.tp is not None:  # fully_shard refuses this before any parameter is built
            raise NotImplementedError("Resharding to smaller mesh is not supported for DTensor parameters yet")
        numel = self.full.numel() // post.shard_size
        self.post_forward = self.full.narrow(0, numel * post.shard_rank, numel).clone()
        rows = torch.empty(self.size, device="meta").chunk(post.shard_size)
        size = rows[post.shard_rank].size() if post.shard_rank < len(rows) else \
            (0, *self.size[1:])
        local = self.post_forward.view(-1)[:torch.Size(size).numel()].view(size)
        self.set_on_modules(nn.Parameter(
            DTensor.from_local(local, post.mesh, post.placements(0), run_check=False,
                               shape=self.size, stride=self.stride),
            requires_grad=self.sharded.requires_grad))
        self.full.untyped_storage().resize_(0)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The gathered copy's dtype: param_dtype, or the shard's own (which .to() may change)."""
        floating = self.padded.dtype.is_floating_point
        return self.param_dtype if self.param_dtype and floating else self.padded.dtype

    def gather_input(self) -> torch.Tensor:
        """What this rank sends to the all-gather: its padded rows (or its post-forward slice),
        flat, on the device, in the compute dtype."""
        mine = self.padded.view(-1) if self.post_forward is None else self.post_forward
        return mine.to(self.device).to(self.compute_dtype)

    def scatter_input(self, grad: torch.Tensor, world: int) -> torch.Tensor:
        """The full gradient, flat, laid as the reduce-scatter cuts it: rank after rank (a
        Shard(dim > 0) gradient's chunks along that dim, stacked along dim 0 first)."""
        if self.shard_dim == 0:
            return grad.reshape(-1)
        return torch.cat(torch.chunk(grad, world, dim=self.shard_dim), dim=0).view(-1)

    def keep_grad(self) -> None:
        """A backward without gradient sync: the full gradient stays for the next backward. With a
        reduce_dtype it is kept in that dtype, and later ones are summed into it (FSDP2's rule)."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is None:
            return
        if self.accumulated is not None or self.reduce_dtype is not None:
            grad = self._local(grad)
        if self.accumulated is not None:
            self.accumulated += grad
        elif self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            self.accumulated = grad.to(self.reduce_dtype)
        else:
            return  # autograd keeps summing into .grad
        self.unsharded.grad = None

    def take_grad(self, zeros_if_unused: bool = False) -> torch.Tensor | None:
        """The full gradient to reduce, removed from the gathered parameter; None if it has none
        (zeros instead with zeros_if_unused, set_reduce_scatter_unused_params)."""
        if self.accumulated is not None:
            self.keep_grad()  # this backward's gradient joins the kept sum
            grad, self.accumulated = self.accumulated, None
            return grad
        if self.unsharded is None:
            return None
        if self.unsharded.grad is None:
            if zeros_if_unused and self.unsharded.requires_grad:
                return self._local(torch.zeros_like(self.unsharded))
            return None
        grad, self.unsharded.grad = self.unsharded.grad, None
        return self._local(grad)

    def _local(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the gathered parameter as a plain tensor (TP's DTensor: its local piece)."""
        return grad if self.tp is None else self.tp.local_grad(grad)

    def add_grad(self, rows: torch.Tensor) -> None:
        """Make `rows` (this rank's rows of the reduced gradient) the DTensor's .grad, or add."""
        rows = rows.view(self.sharded_size)
        if self.offload:
            rows = rows.to("cpu")
        if self.sharded.grad is None:
            self.sharded.grad = self.as_dtensor(rows)
        else:
            with torch.no_grad():
                self.sharded.grad.to_local().add_(rows)
        # register_post_accumulate_grad_hook on the sharded parameter (e.g. an optimizer step in
        # backward): autograd never accumulates into it, so its hooks run here, as FSDP2 runs them
        for hook in (getattr(self.sharded, "_post_accumulate_grad_hooks", None) or {}).values():
            hook(self.sharded)
