"""minidp.ZeroRedundancyOptimizer: ZeRO-1, each rank keeps the optimizer state of its shard only.

Every rank holds all the weights and (after DDP's all-reduce) all the averaged gradients, as in
plain data parallelism; what is split is the optimizer. Each rank builds a local optimizer (`optim`)
over its shard of the parameters (partition.py), steps only those, then every rank broadcasts its
shard so that all ranks end the step with all the updated weights. Adam's two moments per
parameter (8 bytes in fp32) are thus kept once across the ranks instead of once per rank.

Example:
    model = minidp.DDP(net)
    opt = minidp.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    model(x).sum().backward()
    opt.step()  # steps this rank's shard, then broadcasts every shard

overlap_with_ddp=True (the step inside DDP's backward) lives beside this class, in overlap.py: the
class holds a policy, `_stepping`, that says whether step() steps and what may be called when;
StepAfterBackward, at the end of this file, is plain ZeRO-1's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ...engine.collectives import global_rank
from ...validate import check_bool, check_int
from . import arguments, flat_params, overlap, partition, state_dicts
from .reduce_scatter import ReduceScatterStep


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap an optimizer class so that each rank steps and keeps state for its shard of `params`.

    A drop-in for torch's ZeroRedundancyOptimizer: the same arguments, partition,
    errors and state dict format. `param_groups` holds every parameter (as a plain optimizer's
    would: LR schedulers and zero_grad() use it); `optim` is this rank's optimizer over its shard.

    Args:
        params: an iterable of tensors, or of dicts (parameter groups with a "params" key).
        optimizer_class: the local optimizer's class, e.g. torch.optim.AdamW.
        process_group: the ranks that share the state. Default None: the world.
        parameters_as_bucket_view: if True, each rank's shard lives in one flat buffer per device
            (parameters become views into it) and the step ends with one broadcast per rank and
            device instead of one per parameter. Default False.
        overlap_with_ddp: if True, the step runs inside DDP's backward, driven by the comm hook
            hook_with_zero_step (overlap.py); the loop calls no step(). The partition is by DDP
            bucket and is made in the third step; the first two do not update (as torch's).
            Default False.
        reduce_scatter: if True, DDP's all-reduce becomes a reduce-scatter into each rank's shard
            and the step ends with an all-gather (DDP's bytes; reduce_scatter.py), driven by the
            comm hook hook_with_zero_reduce_scatter, which makes the shards. Default False.
        **defaults: the local optimizer's keyword arguments (lr=..., weight_decay=...).
    """

    def __init__(self, params, optimizer_class: type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 reduce_scatter: bool = False, **defaults: Any):
        params = arguments.check_params(params)
        # torch's attribute of this name (its join hook tests read it): the constructor's parameters
        self._all_params = arguments.all_params(params)
        self.initialized = False  # Optimizer.__init__ calls add_param_group: no partition yet
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        # torch's attribute name: hook_with_zero_step (torch's and minidp's) checks it
        self._overlap_with_ddp = check_bool("overlap_with_ddp", overlap_with_ddp)
        self._reduce_scatter = check_bool("reduce_scatter", reduce_scatter)
        optimizer_class = arguments.check_optimizer_class(optimizer_class, self._overlap_with_ddp)
        self.parameters_as_bucket_view = check_bool("parameters_as_bucket_view",
                                                    parameters_as_bucket_view)
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.global_rank = global_rank(self.process_group, self.rank)
        # where checkpoint bytes travel (a CUDA device under NCCL)
        self._default_device = next(p for g in self.param_groups for p in g["params"]).device
        self._optim_defaults = defaults
        self._trainable = self._trainable_mask()
        self._buffers: list[list[torch.Tensor]] = []
        self._all_state_dicts: list[dict] = []  # filled on the `to` rank by consolidate_state_dict
        # The policy, `_stepping`, picked here once: the step in step(), after backward, over the
        # partition made now; or (overlap_with_ddp) inside DDP's backward, where the hook partitions
        # DDP's buckets once they are final (overlap.py).
        if self._reduce_scatter:
            arguments.check_reduce_scatter(overlap_with_ddp, parameters_as_bucket_view)
            self._stepping = ReduceScatterStep(optimizer_class)
        elif self._overlap_with_ddp:
            arguments.check_overlap(self.param_groups, parameters_as_bucket_view)
            self._stepping = overlap.StepInBackward(optimizer_class, self.world_size)
        else:
            self._stepping = StepAfterBackward()
            # Every rank computes every rank's shard: the broadcasts need to know what each sends.
            self._shard(partition.partition_parameters(self.param_groups, self.world_size),
                        optimizer_class, defaults)
            self._build_buffers()
        self.initialized = True

    def _shard(self, shards: list[list[dict]], optimizer_class, defaults: dict) -> None:
        """Keep `shards` (every rank's groups) and build the local optimizer over this rank's."""
        self._partition = shards
        # A list of group dicts (empty groups included) skips Optimizer's empty-list check: a rank
        # may own nothing of a group, or nothing at all when there are more ranks than tensors.
        self.optim = optimizer_class(shards[self.rank], **defaults)
        # the local optimizer filled in its defaults (momentum=0, betas, ...): show them here
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    # -- the step -------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        """Step this rank's shard with the local optimizer, then give every rank every shard.

        Args:
            closure: re-evaluates the model and returns the loss (passed to the local optimizer).
                Default None.
            **kwargs: passed to the local optimizer's step as they are.

        Returns:
            The local optimizer's return value (the closure's loss, if any).
        """
        if not self._stepping.steps_in_step():  # overlap_with_ddp: it stepped in backward
            return None
        Join.notify_join_context(self)  # under Join(): ranks still training shadow a joined rank
        loss = self._local_step(closure, **kwargs)
        self._stepping.share_shards(self)  # plain: the broadcasts; reduce_scatter: all-gathers
        return loss

    def _local_step(self, closure, **kwargs):
        if self._trainable_mask() != self._trainable:
            # requires_grad changed since the buffers were built: a frozen parameter leaves its
            # buffer
            self._build_buffers()
            self._trainable = self._trainable_mask()
        return self._step_local_optimizer(closure, **kwargs)

    def _step_local_optimizer(self, closure=None, **kwargs):
        # An LR scheduler changes `param_groups`: the local optimizer must see the new values.
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _broadcast_shards(self) -> None:
        """Every rank broadcasts what it stepped; all are started, then all are waited for.

        The owner's tensors are the source, so every other rank receives its bits exactly: all ranks
        end the step with the same weights. Every rank issues the same broadcasts in the same order
        (rank by rank, then device by device or parameter by parameter).
        """
        handles = []
        for rank in range(self.world_size):
            src = global_rank(self.process_group, rank)
            for tensor in self._sent_by(rank):
                # ranks meet here: rank `src` sends, the others receive in place
                handles.append(dist.broadcast(tensor, src=src, group=self.process_group,
                                              async_op=True))
        for handle in handles:
            handle.wait()

    def _sent_by(self, rank: int) -> list[torch.Tensor]:
        if self.parameters_as_bucket_view:
            return [per_rank[rank] for per_rank in self._buffers]  # one flat buffer per device
        return [p.data for p in partition.shard_params(self._partition, rank)]

    # -- parameter groups -----------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (call it on all ranks): its parameters join the shards.

        The partition is recomputed over all groups; the greedy rule visits the old groups first and
        meets the same loads, so their parameters keep their ranks and the local optimizer keeps its
        state. Only the new group's part for this rank is added to `optim`.

        Args:
            param_group: a dict with "params" and optional hyperparameters, as for any optimizer.
        """
        if not self.initialized:  # called by Optimizer.__init__ for the constructor's groups
            super().add_param_group(param_group)
            return
        repartition = self._stepping.check_add_param_group()
        super().add_param_group(param_group)
        if not repartition:
            return
        self._partition = partition.partition_parameters(self.param_groups, self.world_size)
        self.optim.add_param_group(self._partition[self.rank][-1])
        self._build_buffers()
        self._trainable = self._trainable_mask()  # the buffers are new: no rebuild at the next step

    @staticmethod
    def _sync_param_groups(src: list[dict], dst: list[dict]) -> None:
        """Copy every hyperparameter (every key but "params") from `src`'s groups to `dst`'s."""
        if len(src) != len(dst):
            raise RuntimeError(f"{len(src)} parameter groups against {len(dst)}: they must match "
                               "one to one")
        for src_group, dst_group in zip(src, dst):
            dst_group.update({k: v for k, v in src_group.items() if k != "params"})

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for g in self.param_groups for p in g["params"]]

    def _build_buffers(self) -> None:
        if self.parameters_as_bucket_view:
            self._buffers = flat_params.build_buffers(self._partition)

    # -- checkpoints ----------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard state on rank `to`, for state_dict() there. Call on all ranks.

        Args:
            to: the group rank that receives the states (default 0).
        """
        to = check_int("to", to, 0, self.world_size - 1)
        self._stepping.check_ready()
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._all_state_dicts = state_dicts.gather_on(self._stepping.local_state_dict(self), to,
                                                      self.process_group, self._default_device)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state as of the last consolidate_state_dict(), on its `to` rank.

        The format is a plain optimizer's over all the parameters ("state" numbered in group order,
        "param_groups" with indices), which torch's ZeroRedundancyOptimizer also writes and reads.
        """
        self._stepping.check_ready()
        if not self._all_state_dicts:
            raise RuntimeError("Optimizer state has not been consolidated on this rank. Please "
                               f"call `consolidate_state_dict(to={self.rank})` on all ranks "
                               "beforehand if you meant to save the global state.")
        return self._stepping.merge_state_dicts(self, super().state_dict(), self._all_state_dicts)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state dict (minidp's or torch's): this rank keeps its shard's.

        Args:
            state_dict: what state_dict() returned (on any world size: the numbering is global).
                It is not changed; the states loaded are copies.
        """
        self._stepping.check_ready()
        # The base class checks the groups match (count and sizes) and takes their hyperparameters;
        # it gets no "state": the wrapper keeps none, the local optimizer does.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._stepping.load_state(self, state_dict["state"])
        self._sync_param_groups(self.param_groups, self.optim.param_groups)

    # -- Join (uneven inputs) -------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Under torch's Join(): a rank out of data still steps (its gradients are zeros by then)
        and broadcasts its shard, so the ranks still training receive it. No keyword arguments."""
        return _StepWhenJoined(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group


class _StepWhenJoined(JoinHook):
    """A joined rank's part of every step the others still take: the step and its broadcasts."""

    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


class StepAfterBackward(state_dicts.WholeTensorState):
    """Plain ZeRO-1's policy (`zero._stepping`): the partition exists from construction on, and
    step() steps, after backward. overlap.StepInBackward answers the same questions for
    overlap_with_ddp=True, where the step runs inside DDP's backward, and
    reduce_scatter.ReduceScatterStep for reduce_scatter=True. (Checkpoints: WholeTensorState.)"""

    def steps_in_step(self) -> bool:
        """Whether step() steps: here always."""
        return True

    def check_add_param_group(self) -> bool:
        """Raise if a parameter group cannot be added now, else say whether the wrapper repartitions
        (reduce_scatter=True before its hook: no, the hook's layout takes every group). Here: yes."""
        return True

    def check_ready(self) -> None:
        """Raise if the partition (and the local optimizer) is not made yet: here it always is."""

    def share_shards(self, zero: ZeroRedundancyOptimizer) -> None:
        """After the local step, every rank gets every shard: here by broadcasts."""
        zero._broadcast_shards()
