"""The optimizer step inside DDP's backward: ZeroRedundancyOptimizer(overlap_with_ddp=True) driven
by hook_with_zero_step, with the behaviour of torch's hook of that name (the tests compare the two).

Why: with plain ZeRO-1, backward ends, then each rank steps its shard, then every rank waits for the
broadcasts of the shards it did not step. Here the step runs inside DDP's comm hook of the last
bucket: each rank steps the buckets it owns, in bucket order, each as soon as that bucket's
all-reduce is done, and starts broadcasting each bucket's new weights at once, while the later
buckets' all-reduces are still in flight. The next forward finds the weights updated; the training
loop has no opt.step().

Everything of this mode is here: ZeroRedundancyOptimizer only holds a StepInBackward as its policy
(`zero._stepping`) and hands it what it asks for. The unit of ownership is DDP's bucket
(bucket_assignment.py), so the partition can only be made once DDP's buckets are final, which
takes two steps:
  step 1   DDP has not rebuilt its buckets yet: the hook only runs `hook` (no update, as torch)
  step 2   the buckets are rebuilt: every hook call records its bucket's parameters (no update)
  step 3   at bucket 0: the partition, the flat per-bucket tensors and the local optimizer are made;
           from this step on every step updates the weights (static_graph=True: a step later)
Ranks must meet in the same order: in the last bucket's hook every rank issues the broadcasts
bucket by bucket (a bucket's owners in rank order), after the same all-reduces. The hook runs on the
thread that runs backward, so the order does not depend on when a collective completes: minidp
allows gloo, which torch refuses for fear of a hang (pytorch#62300) that comes from its interleaved
variant, whose step runs in the all-reduce future's callback on the communication thread.

hook_with_zero_step_interleaved steps earlier: in each hook call, every bucket whose all-reduce has
finished (in bucket order), so the steps and broadcasts run while backward goes on; its broadcasts
have a process group of their own, since when a bucket is stepped differs from rank to rank.
"""
from __future__ import annotations

import inspect
import warnings
import weakref

import torch
import torch.distributed as dist

from ...engine.collectives import global_rank
from ...engine.ddp import DistributedDataParallel
from . import flat_params, partition, state_dicts
from .bucket_assignment import Assignment, assign_buckets, params_of

STEP_LANE, BROADCAST_LANE = "ZeRO: step (own buckets)", "ZeRO: broadcasts"
WAITING, RECORDING = "waiting for DDP to rebuild its buckets", "recording the buckets"
READY = "ready"


class StepInBackward(state_dicts.WholeTensorState):
    """overlap_with_ddp=True: the policy ZeroRedundancyOptimizer holds (`zero._stepping`), and what
    the hook knows: the buckets, who steps what, and this step's futures.

    Args:
        optimizer_class: the local optimizer's class, built once the partition is made.
        world_size: the number of ranks in zero's process group.
    """

    def __init__(self, optimizer_class, world_size: int):
        self.optimizer_class, self.world_size = optimizer_class, world_size
        self.status = WAITING
        self.shard_buckets = False
        self.params_per_bucket: list[list[torch.Tensor]] = []
        self.assignments: list[dict[int, Assignment]] = []  # per rank: bucket index -> Assignment
        self.owners: list[list[int]] = []  # per bucket: the ranks that step a part of it, sorted
        self.broadcast_group = None  # hook_with_zero_step_interleaved's own group (None: zero's)
        # this step: bucket index -> (GradBucket, its all-reduce's future); the first bucket not yet
        # stepped and broadcast; the broadcasts' work handles
        self.futures: dict = {}
        self.next_bucket = 0
        self.handles: list = []

    # -- what ZeroRedundancyOptimizer asks its policy (optimizer.StepAfterBackward: plain ZeRO-1) --

    def steps_in_step(self) -> bool:
        """step() does not step: the hook stepped already, inside backward (torch's warning)."""
        warnings.warn("`step()` should not be included in the training loop when "
                      "`overlap_with_ddp=True`", stacklevel=3)
        return False

    def check_add_param_group(self) -> None:
        raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a "
                           "single parameter group")

    def check_ready(self) -> None:
        """The checkpoint methods need the partition, which the third step makes."""
        if self.status != READY:
            raise RuntimeError("This method should not be called until this "
                               "ZeroRedundancyOptimizer instance has been fully initialized")

    # -- before READY: the partition --------------------------------------------------------------

    def watch_buckets(self, ddp, bucket, zero) -> None:
        """Before READY: wait for the rebuild, record each bucket, then build the partition."""
        if not ddp._has_rebuilt_buckets:  # DDP's buckets may still change
            return
        if self.status == WAITING:
            self.status = RECORDING
        if bucket.index() == 0 and self.params_per_bucket:  # a whole step recorded: buckets known
            self._assign()
            self._build_local_optimizer(zero)
            self.status = READY
        else:
            self.params_per_bucket.append(bucket.parameters())

    def _assign(self) -> None:
        """Who steps what, and a flat tensor for every rank's part of a bucket: each rank receives
        every other's."""
        self.assignments = assign_buckets(self.params_per_bucket, self.world_size,
                                          self.shard_buckets)
        self.owners = [sorted(r for r in range(self.world_size) if b in self.assignments[r])
                       for b in range(len(self.params_per_bucket))]
        for per_rank in self.assignments:
            for a in per_rank.values():
                a.flat = flat_params.flatten_into_buffer(a.params, a.params[0].device)

    def _build_local_optimizer(self, zero) -> None:
        """zero's partition, by bucket, and its local optimizer over this rank's part."""
        group = zero.param_groups[0]
        known = set(group["params"])
        params_per_rank = [params_of(per_rank) for per_rank in self.assignments]
        if any(p not in known for params in params_per_rank for p in params):
            raise ValueError("Passing a new parameter in `params_per_rank` that was not passed "
                             "into the ZeroRedundancyOptimizer constructor")
        defaults = dict(zero._optim_defaults)
        if "foreach" in inspect.signature(self.optimizer_class).parameters:
            defaults.setdefault("foreach", False)  # torch's functional optimizers' arithmetic
        zero._shard([[dict(group, params=params)] for params in params_per_rank],
                    self.optimizer_class, defaults)

    # -- READY: every step --------------------------------------------------------------------

    def note(self, bucket, future) -> None:
        """Keep the bucket and its future until the step; buckets come 0, 1, 2, ... each step."""
        index = bucket.index()
        if index != len(self.futures):
            raise RuntimeError(f"hook_with_zero_step: bucket {index} came after "
                               f"{len(self.futures)} buckets this step; DDP's buckets must be "
                               "launched in index order")
        self.futures[index] = (bucket, future)

    def step_and_broadcast(self, zero, timeline=None, wait_all: bool = True) -> None:
        """Buckets in order from the first not yet done: wait for (or, unless `wait_all`, only take
        if finished) its all-reduce, step this rank's part, broadcast every owner's part.

        Ranks meet here: the same broadcasts, in the same order, on every rank. With `wait_all` (the
        last bucket's call) every bucket is done and every broadcast waited for before returning,
        so the next forward reads updated weights.
        """
        group = self.broadcast_group or zero.process_group
        while self.next_bucket < len(self.futures):
            b = self.next_bucket
            bucket, future = self.futures[b]
            if not (wait_all or future.done()):
                break  # later: in the next hook call, or the last
            mine = self.assignments[zero.rank].get(b)
            if mine is not None:
                future.wait()  # the bucket's gradients are averaged from here on
                record(timeline, "begin", STEP_LANE, f"step bucket {b}")
                grads = bucket.gradients()[mine.offset:mine.offset + len(mine.params)]
                self.step_params(zero, mine.params, grads)
                record(timeline, "end", STEP_LANE, f"step bucket {b}")
            self._broadcast(b, group, timeline)
            self.next_bucket += 1
        if wait_all:
            for work in self.handles:
                work.wait()
            self.handles.clear()
            self.futures.clear()
            self.next_bucket = 0

    def step_params(self, zero, params: list, grads: list) -> None:
        """Step only `params`, with `grads` (views of DDP's bucket): the others' .grad is None
        meanwhile.

        An optimizer skips a parameter whose .grad is None (no state change): this is the step of a
        torch functional optimizer given None for the other parameters. The .grads are restored.
        """
        if zero._trainable_mask() != zero._trainable:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not "
                               "support changing parameter trainability at run time")
        local = partition.shard_params(zero._partition, zero.rank)
        kept = [p.grad for p in local]
        for p in local:
            p.grad = None
        for p, grad in zip(params, grads):
            p.grad = grad
        try:
            zero._step_local_optimizer()
        finally:
            for p, grad in zip(local, kept):
                p.grad = grad

    def _broadcast(self, b: int, group, timeline) -> None:
        """Start the broadcasts of every owner's part of bucket `b` (waited for at the end)."""
        for owner in self.owners[b]:  # ranks meet here: `owner` sends its part of bucket b
            name = f"broadcast bucket {b} from rank {owner}"
            record(timeline, "begin", BROADCAST_LANE, name)
            work = dist.broadcast(self.assignments[owner][b].flat, src=global_rank(group, owner),
                                  group=group, async_op=True)
            self.handles.append(work)
            if timeline is not None:
                work.get_future().add_done_callback(
                    lambda _, n=name: record(timeline, "end", BROADCAST_LANE, n))


def hook_with_zero_step(hook, ddp, zero, shard_buckets: bool = False):
    """`hook`, plus the ZeRO step of every bucket inside the last bucket's call (torch's signature).

    Args:
        hook: a comm hook, hook(state, bucket) -> Future (e.g. torch's allreduce_hook); its future's
            completion means the bucket's buffer holds the averaged gradients.
        ddp: the DDP model (minidp.DDP or torch DDP); read: `_has_rebuilt_buckets`.
        zero: a minidp.ZeroRedundancyOptimizer built with overlap_with_ddp=True.
        shard_buckets: cut buckets across ranks to even the shards (torch's rule). Default False:
            each bucket whole to one rank.
    Returns:
        The hook to register: ddp.register_comm_hook(None, hook_with_zero_step(hook, ddp, zero)).
    """
    return _zero_hook(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(hook, ddp, zero, shard_buckets: bool = False):
    """Like hook_with_zero_step, but a bucket is stepped in the first hook call after its all-reduce
    is done, while backward goes on; the last bucket's call waits for the rest (torch's signature).

    Which call steps a bucket depends on timing and differs between ranks, so the broadcasts go
    through a process group of their own (made here, by the ranks of zero's group): in it every rank
    still issues them in bucket order, whatever the all-reduces do meanwhile. torch's variant steps
    in the all-reduce future's callback, on the communication thread (and refuses gloo); this one
    steps on the thread that runs backward. Same arguments and result as hook_with_zero_step.
    """
    return _zero_hook(hook, ddp, zero, shard_buckets, interleaved=True)


def _zero_hook(hook, ddp, zero, shard_buckets: bool, interleaved: bool):
    if not getattr(zero, "_overlap_with_ddp", False):
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` "
                         "to use this hook properly")
    ddp_ref = weakref.ref(ddp)  # the hook is stored on ddp: no cycle that keeps it alive
    stepping = zero._stepping
    stepping.shard_buckets = bool(shard_buckets)
    if interleaved:  # ranks meet here: the broadcasts' own group, over zero's ranks only
        ranks = dist.get_process_group_ranks(zero.process_group)
        stepping.broadcast_group = dist.new_group(ranks, use_local_synchronization=True)

    def hook_with_zero_fn(state, bucket):
        future = hook(state, bucket)
        if stepping.status != READY:
            stepping.watch_buckets(ddp_ref(), bucket, zero)
            if stepping.status != READY:
                return future
        stepping.note(bucket, future)
        last = bucket.index() == len(stepping.params_per_bucket) - 1
        if interleaved or last:
            stepping.step_and_broadcast(zero, timeline_of(ddp_ref()), wait_all=last)
        return future

    return hook_with_zero_fn


def timeline_of(ddp):
    """minidp.DDP's timeline while model.enable_timeline() records, else None (torch DDP: None)."""
    if not isinstance(ddp, DistributedDataParallel):
        return None
    return ddp.timeline  # set by enable_timeline(), None when off


def record(timeline, kind: str, lane: str, name: str) -> None:
    """A span's "begin" or "end" in a lane of the timeline (drawn by trace_events and
    plot_timelines)."""
    if timeline is not None:
        timeline.record(kind, lane=lane, name=name)
