"""The optimizer step inside DDP's backward: ZeroRedundancyOptimizer(overlap_with_ddp=True) driven by
hook_with_zero_step, with the behaviour of torch's hook of that name (which the tests compare against).

Why: with plain ZeRO-1, backward ends, then each rank steps its shard, then every rank waits for the
broadcasts of the shards it did not step. Here the step runs inside DDP's comm hook of the last
bucket: each rank steps the buckets it owns, in bucket order, each as soon as that bucket's
all-reduce is done, and starts broadcasting each bucket's new weights at once, while the later
buckets' all-reduces are still in flight. The next forward finds the weights updated; the training
loop has no opt.step().

The unit of ownership is DDP's bucket, not the parameter: bucket i belongs to rank i % N, or with
shard_buckets=True buckets are cut into pieces of about 1/N of the model (torch's rule, below). So
the partition can only be made once DDP's buckets are final, which takes two steps:
  step 1   DDP has not rebuilt its buckets yet: the hook only runs `hook` (no update, as torch)
  step 2   the buckets are rebuilt: every hook call records its bucket's parameters (no update)
  step 3   at bucket 0: the partition, the flat per-bucket tensors and the local optimizer are made;
           from this step on every step updates the weights (static_graph=True: a step later)
Ranks must meet in the same order: in the last bucket's hook every rank issues the broadcasts bucket
by bucket (a bucket's owners in rank order), after the same all-reduces. The hook runs on the thread
that runs backward, so the order does not depend on when a collective completes: minidp allows gloo,
which torch refuses for fear of a hang (pytorch#62300) that comes from its interleaved variant, whose
step runs in the all-reduce future's callback on the communication thread.

hook_with_zero_step_interleaved steps earlier: in each hook call, every bucket whose all-reduce has
finished (in bucket order), so the steps and broadcasts run while backward goes on; its broadcasts
have a process group of their own, since when a bucket is stepped differs from rank to rank.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...engine.collectives import global_rank
from . import flat_params

STEP_LANE, BROADCAST_LANE = "ZeRO: step (own buckets)", "ZeRO: broadcasts"
WAITING, RECORDING, READY = "waiting for DDP to rebuild its buckets", "recording the buckets", "ready"


@dataclass
class Assignment:
    """Parameters of one DDP bucket that one rank steps (torch's _DDPBucketAssignment).

    offset: the index of params[0] in the bucket's parameters() (and gradients()).
    flat: the params' data back to back (the params are views into it): what one broadcast sends.
    """
    bucket: int
    params: list
    offset: int
    flat: torch.Tensor | None = None


class Overlap:
    """What the hook knows: the buckets, who steps what, and this step's futures (zero._overlap)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
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

    def watch_buckets(self, ddp, bucket, zero) -> None:
        """Before READY: wait for the rebuild, record each bucket, then build the partition."""
        if not ddp._has_rebuilt_buckets:  # DDP's buckets may still change
            return
        if self.status == WAITING:
            self.status = RECORDING
        if bucket.index() == 0 and self.params_per_bucket:  # a whole step recorded: buckets known
            self.assignments = assign_buckets(self.params_per_bucket, self.world_size, self.shard_buckets)
            self.owners = [sorted(r for r in range(self.world_size) if b in self.assignments[r])
                           for b in range(len(self.params_per_bucket))]
            for per_rank in self.assignments:  # every rank's: each rank receives every other's
                for a in per_rank.values():
                    a.flat = flat_params.flatten_into_buffer(a.params, a.params[0].device)
            zero._init_for_overlap([params_of(per_rank) for per_rank in self.assignments])
            self.status = READY
        else:
            self.params_per_bucket.append(bucket.parameters())

    def note(self, bucket, future) -> None:
        """Keep the bucket and its future until the step; buckets must come 0, 1, 2, ... each step."""
        index = bucket.index()
        if index != len(self.futures):
            raise RuntimeError(f"hook_with_zero_step: bucket {index} came after {len(self.futures)} "
                               "buckets this step; DDP's buckets must be launched in index order")
        self.futures[index] = (bucket, future)


def assign_buckets(params_per_bucket: list[list], world_size: int, shard_buckets: bool) -> list[dict]:
    """Per rank, {bucket index: Assignment}, in the order torch assigns them.

    shard_buckets=False: bucket i, whole, to rank i % world_size. True: buckets in increasing size
    (a stable sort); each is cut, in parameter order, into pieces that stop before the parameter that
    would reach total/world_size elements; each piece goes to the rank with the fewest elements so far
    that has no piece of this bucket yet (the lowest such rank on a tie).
    """
    out: list[dict[int, Assignment]] = [{} for _ in range(world_size)]
    if not shard_buckets:
        for b, params in enumerate(params_per_bucket):
            out[b % world_size][b] = Assignment(b, list(params), 0)
        return out
    threshold = sum(p.numel() for ps in params_per_bucket for p in ps) / world_size
    loads = [0] * world_size
    by_size = sorted(enumerate(params_per_bucket), key=lambda bp: sum(p.numel() for p in bp[1]))
    for b, params in by_size:
        start, size = 0, 0
        pieces = []
        for i, p in enumerate(params):
            if size + p.numel() >= threshold and i > start:
                pieces.append((start, i, size))
                start, size = i, 0
            size += p.numel()
        pieces.append((start, len(params), size))
        if len(pieces) > world_size:  # torch: AssertionError("All indices are disallowed")
            raise RuntimeError(f"shard_buckets=True: bucket {b} would be cut into {len(pieces)} pieces for "
                               f"{world_size} ranks (each piece stops below {threshold:g} elements, 1/N of the "
                               "model); use shard_buckets=False or larger buckets")
        taken: set[int] = set()
        for first, end, piece_size in pieces:
            rank = min((r for r in range(world_size) if r not in taken), key=lambda r: loads[r])
            out[rank][b] = Assignment(b, list(params[first:end]), first)
            taken.add(rank)
            loads[rank] += piece_size
    return out


def params_of(per_rank: dict[int, Assignment]) -> list[torch.Tensor]:
    """A rank's parameters, assignment after assignment: its local optimizer's order."""
    return [p for a in per_rank.values() for p in a.params]


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
        raise ValueError("ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
                         "this hook properly")
    ddp_ref = weakref.ref(ddp)  # the hook is stored on ddp: no cycle that keeps it alive
    overlap = zero._overlap
    overlap.shard_buckets = bool(shard_buckets)
    if interleaved:  # ranks meet here: the broadcasts' own group, over zero's ranks only
        ranks = dist.get_process_group_ranks(zero.process_group)
        overlap.broadcast_group = dist.new_group(ranks, use_local_synchronization=True)

    def hook_with_zero_fn(state, bucket):
        future = hook(state, bucket)
        if overlap.status != READY:
            overlap.watch_buckets(ddp_ref(), bucket, zero)
            if overlap.status != READY:
                return future
        overlap.note(bucket, future)
        last = bucket.index() == len(overlap.params_per_bucket) - 1
        if interleaved or last:
            step_and_broadcast(zero, overlap, timeline_of(ddp_ref()), wait_all=last)
        return future

    return hook_with_zero_fn


def step_and_broadcast(zero, overlap: Overlap, timeline=None, wait_all: bool = True) -> None:
    """Buckets in order from the first not yet done: wait for (or, unless `wait_all`, only take if
    finished) its all-reduce, step this rank's part, broadcast every owner's part.

    Ranks meet here: the same broadcasts, in the same order, on every rank. With `wait_all` (the last
    bucket's call) every bucket is done and every broadcast waited for before returning, so the next
    forward reads updated weights.
    """
    rank = zero.rank
    group = overlap.broadcast_group or zero.process_group
    while overlap.next_bucket < len(overlap.futures):
        b = overlap.next_bucket
        bucket, future = overlap.futures[b]
        if not (wait_all or future.done()):
            break  # later: in the next hook call, or the last
        mine = overlap.assignments[rank].get(b)
        if mine is not None:
            future.wait()  # the bucket's gradients are averaged from here on
            record(timeline, "begin", STEP_LANE, f"step bucket {b}")
            grads = bucket.gradients()[mine.offset:mine.offset + len(mine.params)]
            zero._step_params(mine.params, grads)
            record(timeline, "end", STEP_LANE, f"step bucket {b}")
        for owner in overlap.owners[b]:  # ranks meet here: `owner` sends its part of bucket b
            flat = overlap.assignments[owner][b].flat
            name = f"broadcast bucket {b} from rank {owner}"
            record(timeline, "begin", BROADCAST_LANE, name)
            work = dist.broadcast(flat, src=global_rank(group, owner), group=group, async_op=True)
            overlap.handles.append(work)
            if timeline is not None:
                work.get_future().add_done_callback(lambda _, n=name: record(timeline, "end", BROADCAST_LANE, n))
        overlap.next_bucket += 1
    if wait_all:
        for work in overlap.handles:
            work.wait()
        overlap.handles.clear()
        overlap.futures.clear()
        overlap.next_bucket = 0


def timeline_of(ddp):
    """minidp.DDP's timeline while model.enable_timeline() records, else None (torch DDP: None)."""
    return getattr(getattr(getattr(ddp, "reducer", None), "recorder", None), "timeline", None)


def record(timeline, kind: str, lane: str, name: str) -> None:
    """A span's "begin" or "end" in a lane of the timeline (drawn by trace_events and plot_timelines)."""
    if timeline is not None:
        timeline.record(kind, lane=lane, name=name)
