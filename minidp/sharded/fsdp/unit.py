"""A unit: the parameters one fully_shard call manages, gathered and reduced together.

The life of a unit in one training step (FSDP2's FSDPParamGroup):
  pre_forward    all-gather the parameters (one collective), put the gathered ones in the modules,
                 and mark the unit's inputs so that autograd calls post_backward when the gradients
                 of those inputs are computed, i.e. when the unit's own backward is done
  post_forward   reshard_after_forward=True: put the shards back, free the gathered memory (ZeRO-3);
                 False: keep them gathered for backward (ZeRO-2, SHARD_GRAD_OP); an int k: keep a
                 shard over k ranks, so that backward's gather stays within those k
  pre_backward   gather again if they were freed (hooked on the unit's outputs), and start the
                 gather of the unit backward reaches next (prefetch.ForwardOrder says which)
  post_backward  take the full gradients, reshard, start the reduce-scatter (one collective, among
                 the root's collectives.ReducesInFlight; under HSDP an all-reduce across the
                 replicas follows, replicas.py); at the end of backward each rank keeps the
                 averaged gradient of its rows as the DTensor parameter's .grad
"""
from __future__ import annotations

from enum import Enum, auto

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .collectives import Gather, ReduceOptions, ReduceScatter, ReducesInFlight
from .prefetch import ForwardOrder
from .replicas import ReplicaAllReduce
from .sharded_param import ShardedParam

GATHER_LANE, REDUCE_LANE = "fully_shard all-gather", "fully_shard reduce-scatter"  # timeline lanes


class Phase(Enum):
    """Where a unit (or a module's state) is in the step."""
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class Unit:
    """The parameters of one fully_shard call and their collectives.

    Args:
        params: [(parameter, [(module, name), ...]), ...] in FSDP2's order (modules after their
            children, parameters in registration order): the flat buffers' layout.
        mesh: the ShardMesh (mesh.py): the shard group runs the all-gather and the reduce-scatter,
            the replicate group (HSDP) the all-reduce.
        device: where the gathered parameters and the collectives live.
        post_forward: where the parameters live between forward and backward (mesh.py's
            post_forward_mesh: `mesh` for reshard_after_forward=True, None for False, a smaller
            mesh for an int).
        mp_policy: torch's MixedPrecisionPolicy (the dtypes of the gathered copies and of the
            reduction; fully_shard's hooks cast the inputs and outputs).
        shard_dims: each parameter's sharded dim (default None: all 0; shard_placement_fn).
        offload: torch's CPUOffloadPolicy, or None: the shards and their gradients on the CPU.
    """

    def __init__(self, params: list, mesh, device: torch.device, post_forward, mp_policy,
                 shard_dims: list | None = None, offload=None):
        shard_dims = shard_dims or [0] * len(params)
        pin = getattr(offload, "pin_memory", False)
        self.params = [ShardedParam(p, places, mesh, device, mp_policy, dim, offload is not None,
                                    pin) for (p, places), dim in zip(params, shard_dims)]
        trainable = [p for p in self.params if p.sharded.requires_grad]
        if len({(p.padded.dtype, p.reduce_dtype) for p in trainable}) > 1:
            raise ValueError("fully_shard needs one dtype for a unit's trainable parameters; got "
                             f"{sorted({str(p.padded.dtype) for p in trainable})}: shard them "
                             "in separate fully_shard calls")
        self.mesh, self.device, self.offload = mesh, device, offload
        self.post_forward_mesh = post_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True  # reduce at all (FSDP2's reduce_grads)
        self.unshard_in_backward = True
        self.reduce_scatter_unused_params = False
        self.all_gather_comm = None  # set_custom_all_gather
        self.symmetric_memory = False  # set_symm_mem_for_comm (CUDA only)
        self.reduce_options = ReduceOptions(
            ReplicaAllReduce(mesh.replicate_group, mesh.replicate_size) if mesh.is_hsdp else None)
        self.reduce_options.span = self._span
        self.phase = Phase.IDLE
        self.is_unsharded = False
        self.is_post_forward = False  # holding the int reshard_after_forward's shard
        self.gather: Gather | None = None  # an all-gather started early (prefetch), not waited yet
        self.timeline = None  # a minidp Timeline while the root's enable_timeline() records
        self.name = ""  # the module's name under the root, in the timeline
        # a state dict is saved from, and loaded into, the shards (FSDP2's to_sharded_hook): the
        # module may hold its gathered weights, e.g. after a forward without backward
        for module in {module for p in self.params for module, _ in p.places}:
            module.register_state_dict_pre_hook(lambda *args: self.reshard())
            module.register_load_state_dict_pre_hook(lambda *args: self.reshard())
            # load_state_dict(assign=True) puts new tensors in the module: adopt them
            module.register_load_state_dict_post_hook(lambda *args: self.reset())

    @property
    def reshard_after_forward(self) -> bool:
        return self.post_forward_mesh is not None

    @reshard_after_forward.setter
    def reshard_after_forward(self, reshard: bool) -> None:
        self.post_forward_mesh = self.mesh if reshard else None

    def reset(self) -> None:
        """Adopt parameters that replaced the shards (see ShardedParam.reset)."""
        for p in self.params:
            p.reset()

    def check_offload(self) -> None:
        """At the root's first forward: with CPU offload the shards must be on the CPU."""
        elsewhere = [(p.places[0][1], p.sharded.device) for p in self.params
                     if p.sharded.device.type != "cpu"]
        if self.offload is not None and elsewhere:
            raise RuntimeError(
                "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
                'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
                f"Found following parameters on non-CPU device: {elsewhere}\n")

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the parameters, put the gathered ones in the modules (no-op if they are).

        async_op=True starts the all-gather and returns: the next unshard() or wait_for_unshard()
        finishes it (a prefetch)."""
        # set_unshard_in_backward(False): backward needs no parameter of this unit
        skip = not self.unshard_in_backward and self.phase == Phase.PRE_BACKWARD
        if not self.is_unsharded and self.gather is None and not skip:
            mesh = self.post_forward_mesh if self.is_post_forward else self.mesh
            if self.symmetric_memory and mesh.shard_size > 1 and self.device.type != "cuda":
                raise RuntimeError("SymmetricMemory MemPool did not find backend for device type "
                                   f"{self.device.type}")
            span = self._span(GATHER_LANE) if mesh.shard_size > 1 else None
            self.gather = Gather(self.params, mesh.shard_group, mesh.shard_rank, mesh.shard_size,
                                 async_op, on_done=span, comm=self.all_gather_comm)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.gather is None:
            return
        gather, self.gather = self.gather, None
        gather.wait()
        for p in self.params:
            p.to_unsharded()
        self.is_unsharded, self.is_post_forward = True, False

    def reshard(self) -> None:
        """Put the shards back in the modules and free the gathered parameters' memory. A gather
        started and not waited for stays pending (FSDP2's): the next unshard() uses it; the end of
        the step's last backward drops it (drop_prefetch)."""
        for p in self.params:
            p.to_sharded()
        self.is_unsharded = self.is_post_forward = False

    def pre_forward(self, args: tuple, kwargs: dict,
                    reduces: ReducesInFlight) -> tuple[tuple, dict]:
        """Gather, and arm post_backward on the inputs (its reduce-scatter joins `reduces`)."""
        entering = self.phase != Phase.FORWARD  # a list's next module: its hook is armed
        self.phase = Phase.FORWARD
        self.unshard()
        return self._hook_inputs(args, kwargs, reduces) if entering else (args, kwargs)

    def post_forward(self) -> None:
        if self.post_forward_mesh is self.mesh:
            self.reshard()
        elif self.post_forward_mesh is not None and self.is_unsharded:
            for p in self.params:  # an int reshard_after_forward
                p.to_post_forward(self.post_forward_mesh)
            self.is_unsharded, self.is_post_forward = False, True
        self.phase = Phase.IDLE

    def pre_backward(self, forward_order: ForwardOrder, prefetch: list | None = None) -> None:
        """Gather (or finish the prefetch), then start the gathers of the units in `prefetch`
        (default None: the unit whose forward ran just before this one's, whose backward comes
        next, from `forward_order`; FSDP2's default backward prefetch)."""
        if self.phase == Phase.PRE_BACKWARD:
            return  # one of several outputs already did it
        self.phase = Phase.PRE_BACKWARD
        self.unshard()
        if prefetch is None:
            prefetch = forward_order.pop_previous(self)
        for unit in prefetch:
            unit.prefetch(Phase.PRE_BACKWARD)

    def prefetch(self, phase: Phase) -> None:
        """Start this unit's gather early, as if in `phase` (set_unshard_in_backward applies)."""
        before, self.phase = self.phase, phase
        self.unshard(async_op=True)  # ranks meet here (started)
        self.phase = before

    def post_backward(self, reduces: ReducesInFlight) -> None:
        """Reshard and reduce-scatter the gradients (the collective joins `reduces`, the root's
        reduce-scatters in flight); idempotent within one backward."""
        self.phase = Phase.POST_BACKWARD
        if not self.requires_gradient_sync:  # accumulate: full grads stay on the gathered params
            for p in self.params:
                p.keep_grad()
            if self.reshard_after_backward:
                self.reshard()
            return
        with_grad, grads = [], []
        for p in self.params:
            grad = p.take_grad(self.reduce_scatter_unused_params)
            if grad is not None:  # unused in this step: no gradient, as in FSDP2
                with_grad.append(p)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        reduces.make_room()  # the previous unit's: its .grad are set now, its buffer freed
        if grads:
            group = self.mesh.reduce_scatter_group or self.mesh.shard_group
            # ranks meet here; autograd goes on with the rest of backward while it runs
            span = self._span(REDUCE_LANE) if self.mesh.shard_size > 1 else None
            reduces.add(ReduceScatter(with_grad, grads, group, self.mesh.shard_size,
                                      async_op=True, on_done=span, options=self.reduce_options))

    def drop_prefetch(self) -> None:
        """A gather prefetched and never used (a mistargeted prefetch): let it finish, unused."""
        if self.gather is not None:
            self.gather.wait(copy_out=False)
            self.gather = None

    def discard_step(self) -> None:
        """reset_iter_state: finish any gather, drop what a failed step left, reshard."""
        self.drop_prefetch()
        if self.reduce_options.replicas is not None:
            self.reduce_options.replicas.discard()
        for p in self.params:
            p.accumulated = None
        self.reshard()
        self.phase = Phase.IDLE

    def _span(self, lane: str):
        """While a timeline records: record a collective's "begin" now, and return what records
        its "end" (called when the host has waited for it; gloo's reduce-scatter work has no
        future to say when it completed). Else None."""
        if self.timeline is None:
            return None
        timeline, name = self.timeline, self.name
        timeline.record("begin", lane=lane, name=name)
        return lambda: timeline.record("end", lane=lane, name=name)

    def _hook_inputs(self, args: tuple, kwargs: dict,
                     reduces: ReducesInFlight) -> tuple[tuple, dict]:
        """Pass the inputs that require grad through PostBackward (its backward: post_backward)."""
        if not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not index:  # e.g. the first unit: its inputs are data; the root's final callback runs it
            return args, kwargs
        outs = PostBackward.apply(self, reduces, *[leaves[i] for i in index])
        for i, out in zip(index, outs):
            leaves[i] = out
        return tree_unflatten(leaves, spec)


class PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs when all the unit's gradients are computed."""

    @staticmethod
    def forward(ctx, unit: Unit, reduces: ReducesInFlight, *inputs: torch.Tensor):
        ctx.unit, ctx.reduces = unit, reduces
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.post_backward(ctx.reduces)
        return (None, None) + grads
