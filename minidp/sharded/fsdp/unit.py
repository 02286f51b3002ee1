"""A unit: the parameters one fully_shard call manages, gathered and reduced together.

The life of a unit in one training step (FSDP2's FSDPParamGroup):
  pre_forward    all-gather the parameters (one collective), put the gathered ones in the modules,
                 and mark the unit's inputs so that autograd calls post_backward when the gradients
                 of those inputs are computed, i.e. when the unit's own backward is done
  post_forward   reshard_after_forward=True: put the shards back, free the gathered memory (ZeRO-3);
                 False: keep them gathered for backward (ZeRO-2, SHARD_GRAD_OP)
  pre_backward   gather again if they were freed (hooked on the unit's outputs), and start the
                 gather of the unit backward reaches next (prefetch.ForwardOrder says which)
  post_backward  take the full gradients, reshard, start the reduce-scatter (one collective, among
                 the root's collectives.ReducesInFlight); at the end of backward each rank keeps
                 the averaged gradient of its rows as the DTensor parameter's .grad
"""
from __future__ import annotations

from enum import Enum, auto

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .collectives import Gather, ReduceScatter, ReducesInFlight
from .prefetch import ForwardOrder
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
        mesh: a 1-D DeviceMesh; its process group runs the collectives.
        device: where the shards live.
        reshard_after_forward: free the gathered parameters after forward (fully_shard's default).
        mp_policy: torch's MixedPrecisionPolicy (the dtypes of the gathered copies and of the
            reduction; fully_shard's hooks cast the inputs and outputs).
    """

    def __init__(self, params: list, mesh, device: torch.device, reshard_after_forward: bool,
                 mp_policy):
        self.params = [ShardedParam(p, places, mesh, device, mp_policy) for p, places in params]
        trainable = [p for p in self.params if p.sharded.requires_grad]
        if len({(p.padded.dtype, p.reduce_dtype) for p in trainable}) > 1:
            raise ValueError("fully_shard needs one dtype for a unit's trainable parameters; got "
                             f"{sorted({str(p.padded.dtype) for p in trainable})}: shard them "
                             "in separate fully_shard calls")
        self.group, self.world, self.rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.phase = Phase.IDLE
        self.is_unsharded = False
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

    def reset(self) -> None:
        """Adopt parameters that replaced the shards (see ShardedParam.reset)."""
        for p in self.params:
            p.reset()

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the parameters, put the gathered ones in the modules (no-op if they are).

        async_op=True starts the all-gather and returns: the next unshard() or wait_for_unshard()
        finishes it (a prefetch)."""
        if not self.is_unsharded and self.gather is None:
            self.gather = Gather(self.params, self.group, self.rank, self.world, async_op,
                                 on_done=self._span(GATHER_LANE))
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.gather is None:
            return
        gather, self.gather = self.gather, None
        gather.wait()
        for p in self.params:
            p.to_unsharded()
        self.is_unsharded = True

    def reshard(self) -> None:
        """Put the shards back in the modules and free the gathered parameters' memory."""
        if self.gather is not None:  # prefetched but never used: let the collective finish
            self.gather.wait(copy_out=False)
            self.gather = None
        for p in self.params:
            p.to_sharded()
        self.is_unsharded = False

    def pre_forward(self, args: tuple, kwargs: dict,
                    reduces: ReducesInFlight) -> tuple[tuple, dict]:
        """Gather, and arm post_backward on the inputs (its reduce-scatter joins `reduces`)."""
        self.phase = Phase.FORWARD
        self.unshard()
        return self._hook_inputs(args, kwargs, reduces)

    def post_forward(self) -> None:
        if self.reshard_after_forward:
            self.reshard()
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
            unit.unshard(async_op=True)  # ranks meet here (started)

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
            grad = p.take_grad()
            if grad is not None:  # unused in this step: no gradient, as in FSDP2
                with_grad.append(p)
                grads.append(grad)
        if self.reshard_after_backward:
            self.reshard()
        if grads:
            reduces.wait()  # the previous unit's: its .grad are set now, its buffer freed
            # ranks meet here; autograd goes on with the rest of backward while it runs
            reduces.add(ReduceScatter(with_grad, grads, self.group, self.world, async_op=True,
                                      on_done=self._span(REDUCE_LANE)))

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
