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

The module's original parameter is replaced, not changed: an optimizer built before fully_shard
would go on stepping it, a tensor no forward reads any more, and train nothing without a word.
Each replaced parameter is marked, and one optimizer step pre-hook (torch's, global to every
optimizer, registered at the first fully_shard) raises at such an optimizer's first step.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

REPLACED = "_minidp_replaced_by_fully_shard"  # marks an original parameter: where it was
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
        mesh: a 1-D DeviceMesh over the ranks that share the parameter.
        device: where the shard lives.
        mp_policy: torch's MixedPrecisionPolicy: param_dtype is the gathered copy's dtype (the
            shard keeps the parameter's), reduce_dtype the gradients' in the reduce-scatter.
    """

    def __init__(self, param: nn.Parameter, places: list, mesh, device: torch.device, mp_policy):
        self.places, self.mesh = places, mesh
        world, rank = mesh.size(), mesh.get_local_rank()
        if not param.is_contiguous():  # FSDP2's refusal, word for word
            raise NotImplementedError("FSDP does not support non-contiguous parameters yet: "
                                      f"{param.shape=} {param.stride()=}")
        # a meta parameter stays meta (deferred init: to_empty() then an init or a load; reset())
        data = param.detach() if param.is_meta else param.detach().to(device)
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
        mark_replaced(param, places)
        # FSDP2's clamps: no reduce cast when it equals param_dtype, no cast of a non-float param
        self.param_dtype = mp_policy.param_dtype
        self.reduce_dtype = None if mp_policy.reduce_dtype == self.param_dtype \
            else mp_policy.reduce_dtype
        self.accumulated: torch.Tensor | None = None  # gradients kept across unsynced backwards

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
        self.padded[:local.size(0)].copy_(local)
        new = nn.Parameter(self.as_dtensor(self.padded[:local.size(0)]),
                           requires_grad=current.requires_grad)
        torch.utils.swap_tensors(current, new)  # the same object: an optimizer may hold it
        self.sharded = current
        self.full = self.unsharded = None  # made again, on the shard's device, at the next gather
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
            empty = torch.empty(0, dtype=self.compute_dtype, device=self.padded.device)
            storage = torch.empty(numel, dtype=self.compute_dtype, device=self.padded.device)
            storage = storage.untyped_storage()
            self.full = empty.clone().set_(storage, 0, (numel,), (1,))
            view = empty.clone().set_(storage, 0, self.size, self.stride)
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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The gathered copy's dtype: param_dtype, or the shard's own (which .to() may change)."""
        floating = self.padded.dtype.is_floating_point
        return self.param_dtype if self.param_dtype and floating else self.padded.dtype

    def gather_input(self) -> torch.Tensor:
        """What this rank sends to the all-gather: its padded rows, flat, in the compute dtype."""
        return self.padded.view(-1).to(self.compute_dtype)

    def keep_grad(self) -> None:
        """A backward without gradient sync: the full gradient stays for the next backward. With a
        reduce_dtype it is kept in that dtype, and later ones are summed into it (FSDP2's rule)."""
        grad = None if self.unsharded is None else self.unsharded.grad
        if grad is None:
            return
        if self.accumulated is not None:
            self.accumulated += grad
        elif self.reduce_dtype is not None and grad.dtype != self.reduce_dtype:
            self.accumulated = grad.to(self.reduce_dtype)
        else:
            return  # autograd keeps summing into .grad
        self.unsharded.grad = None

    def take_grad(self) -> torch.Tensor | None:
        """The full gradient to reduce, removed from the gathered parameter; None if it has none."""
        if self.accumulated is not None:
            self.keep_grad()  # this backward's gradient joins the kept sum
            grad, self.accumulated = self.accumulated, None
            return grad
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
