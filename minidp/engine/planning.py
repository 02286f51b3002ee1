"""Bucket layout: which parameters share one flat all-reduce buffer, and the buffers. No process group.

The rules reproduce torch DDP's, so that a bucket holds the same gradients at the same offsets as
DDP's does (that is what bitwise equality at 3+ ranks needs, since gloo's ring sums an element in
an order that depends on where it sits in the buffer):

  * walk the parameters in the given order; group them by (dtype, device); each group fills a
    bucket until its byte size reaches the current limit (>=, so a bucket may pass the limit by
    one tensor), then starts a new one and moves on to the next limit of the list (staying on the
    last limit);
  * a parameter with a sparse gradient gets a bucket of its own, added when it is walked (sparse
    tensors cannot share a flat buffer); it takes no part in the size limits;
  * leftover partial buckets are added at the end;
  * at construction the order is registration order, the buckets are sorted by their smallest
    index and the list is reversed (the last-defined parameters' gradients arrive first); inside a
    bucket the parameters stay in registration order;
  * after the first iteration the order is the order gradients became ready, and nothing is
    sorted or reversed.

With bucket_cap_mb="auto", `AutoCap` picks the cap (see its docstring).

`build_buckets` then allocates one flat buffer per planned bucket, and the views through which each
parameter's gradient is read and written (`flat_view`); `write_back` gives each parameter its
reduced gradient from a bucket's result.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
UNBOUNDED = sys.maxsize


def bucket_limits(bucket_cap_mb: float | None, first_iteration: bool, needs_rebuild: bool) -> list[int]:
    """The list of byte limits DDP walks for one plan.

    Args:
        bucket_cap_mb: the user's cap in MiB; None means DDP's default (25 MiB, with a 1 MiB
            first bucket).
        first_iteration: True for the plan made at construction, False for the rebuilt one.
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: the buckets are
            rebuilt in gradient-ready order after the first iteration.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first_cap = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    if first_iteration and needs_rebuild:
        # The real backward order is unknown yet: reduce everything at the end, in one bucket.
        return [UNBOUNDED]
    return [first_cap, cap] if first_cap < cap else [cap]


def assign_buckets(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                   order: Sequence[int] | None = None, sparse: Sequence[bool] = ()) -> list[list[int]]:
    """Cut tensors into buckets by byte size; DDP's compute_bucket_assignment_by_size.

    Args:
        sizes: byte size of each tensor (numel * element_size), by tensor index.
        keys: a group key per tensor index, e.g. (dtype, device); groups never share a bucket.
        limits: byte limits, used in turn per group; the last one repeats.
        order: tensor indices in the order to walk them. Default: 0, 1, 2, ... in which case the
            buckets are sorted by their smallest index, as DDP does.
        sparse: by tensor index, whether its gradient is sparse (each gets a bucket of its own).
            Default: none.

    Returns:
        A list of buckets, each a list of tensor indices in the order walked.
    """
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"limits={list(limits)} must be a non-empty list of positive byte sizes")
    walk = range(len(sizes)) if order is None else order
    open_buckets: OrderedDict = OrderedDict()  # key -> [indices, bytes]; first-seen key first
    limit_pos: dict = {}
    result = []
    for index in walk:
        if sparse and sparse[index]:
            result.append([index])
            continue
        key = keys[index]
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += sizes[index]
        pos = limit_pos.setdefault(key, 0)
        if bucket[1] >= limits[pos]:
            result.append(bucket[0])
            open_buckets[key] = [[], 0]
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    if order is None:
        result.sort(key=min)
    return result


def plan_initial(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The construction-time plan: registration order, buckets reversed (last layers first)."""
    return list(reversed(assign_buckets(sizes, keys, limits, sparse=sparse)))


def plan_rebuilt(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 ready_order: Sequence[int], sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The plan after the first iteration: the order in which gradients became ready."""
    if sorted(ready_order) != list(range(len(sizes))):
        raise ValueError(f"ready_order={list(ready_order)} must be a permutation of 0..{len(sizes) - 1}")
    return assign_buckets(sizes, keys, limits, order=ready_order, sparse=sparse)


# ---- the buffers -----------------------------------------------------------------------------------

@dataclass
class Bucket:
    """A flat buffer holding some parameters' gradients back to back, and its per-iteration state.

    A parameter with a sparse gradient has a bucket of its own, whose `buffer` is that gradient itself
    (set each iteration; sparse tensors cannot be packed into a flat buffer), with no views.
    """

    index: int
    param_indices: list[int]      # into the reducer's parameters, in buffer order
    offsets: list[int]            # element offset of each gradient in `buffer`
    buffer: torch.Tensor
    views: list[torch.Tensor]     # each parameter's gradient inside `buffer` (flat_view)
    sparse: bool = False
    pending: int = 0              # gradients still to arrive this iteration
    deferred: list = field(default_factory=list, repr=False)  # (slot, grad, param) to copy at launch
    in_place: list = field(default_factory=list, repr=False)  # slots already holding their gradient
    future: torch.futures.Future | None = field(default=None, repr=False)


def build_buckets(plan: list[list[int]], params: list, sparse: Sequence[bool]) -> list[Bucket]:
    """One buffer per planned bucket (allocated once per layout, never per step)."""
    buckets = []
    for b, indices in enumerate(plan):
        first = params[indices[0]]
        if sparse[indices[0]]:
            buckets.append(Bucket(b, list(indices), [0], no_sparse_gradient(first), [], sparse=True))
            continue
        offsets = list(itertools.accumulate((params[i].numel() for i in indices), initial=0))
        # Empty, not zeros: every slot is written (gradient or zeros) before each all-reduce.
        buffer = torch.empty(offsets.pop(), dtype=first.dtype, device=first.device)
        views = [flat_view(buffer, offset, params[i]) for i, offset in zip(indices, offsets)]
        buckets.append(Bucket(b, list(indices), offsets, buffer, views))
    return buckets


def flat_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slot of `like`'s gradient in a flat buffer: `like.numel()` elements from `offset`.

    As DDP's bucket views: with `like`'s strides when its memory is dense (e.g. channels_last
    weights get channels_last gradients, laid out in the buffer in memory order), else C-contiguous.
    """
    if like.is_contiguous() or _non_overlapping_and_dense(like):  # is_contiguous: the common case, in C
        return buffer.as_strided(like.shape, like.stride(), buffer.storage_offset() + offset)
    return buffer[offset:offset + like.numel()].view(like.shape)


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory exactly once, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def no_sparse_gradient(like: torch.Tensor) -> torch.Tensor:
    """An all-zero sparse gradient (nnz=0) shaped like an embedding's: one sparse dimension, as the
    real ones have (gloo's sparse all-reduce requires the same sparse/dense dimensions on all ranks)."""
    return torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64, device=like.device),
                                   torch.empty(0, *like.shape[1:], dtype=like.dtype, device=like.device),
                                   like.shape)


def sparse_gradient_flags(module: torch.nn.Module, params: list) -> list[bool]:
    """By parameter, whether its gradient will be sparse; DDP's rule: its module is an nn.Embedding or
    nn.EmbeddingBag with sparse=True (for a shared parameter, the first module that has it)."""
    if not any(isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse for sub in module.modules()):
        return [False] * len(params)  # the common case: no sparse embedding at all
    sparse_owner: dict = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            sparse_owner.setdefault(p, isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse)
    return [sparse_owner.get(p, False) for p in params]


def write_back(bucket: Bucket, result: torch.Tensor, params: list, gradient_as_bucket_view: bool,
               globally_unused: set) -> None:
    """Each parameter of `bucket` gets its reduced gradient from `result` (the bucket's reduced buffer).

    Copied into `.grad` (in one batched op), or, with gradient_as_bucket_view, `.grad` is the bucket's
    view. A parameter no rank produced a gradient for keeps its `.grad` as it is (None), as in DDP.
    """
    if bucket.sparse:  # as DDP: the reduced values go into the gradient tensor itself
        param = params[bucket.param_indices[0]]
        if bucket.param_indices[0] not in globally_unused and param.grad is None:  # unused here only
            param.grad = result.clone()
        elif bucket.param_indices[0] not in globally_unused and result is not param.grad:
            param.grad.copy_(result)
        return
    if result is bucket.buffer and not gradient_as_bucket_view and not globally_unused:
        grads = [params[i].grad for i in bucket.param_indices]
        if all(g is not None for g in grads):  # the usual step: one batched copy, no per-gradient branches
            torch._foreach_copy_(grads, bucket.views)
            return
    copy_to, copy_from = [], []
    for slot, i in enumerate(bucket.param_indices):
        if i in globally_unused:
            continue
        param, view = params[i], bucket.views[slot]
        out = view if result is bucket.buffer else flat_view(result, bucket.offsets[slot], param)
        if gradient_as_bucket_view:
            if out is not view:
                copy_to.append(view)
                copy_from.append(out)
            if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                param.grad = view
        elif param.grad is None:
            param.grad = out.clone()
        else:
            copy_to.append(param.grad)
            copy_from.append(out)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)


def check_sparse_backend(params: list, names: list, sparse: Sequence[bool], backend: str) -> None:
    """Refuse sparse gradients where the backend has no sparse all-reduce, naming the parameter.

    Only gloo has one: torch DDP on NCCL constructs, then fails in backward ("allreduce_sparse is
    only available in the NCCL experimental branch").

    Args:
        backend: the process group's, e.g. "gloo", "nccl", or one per device type "cpu:gloo,cuda:nccl".
    """
    per_device = dict(part.split(":") for part in backend.split(",")) if ":" in backend else {}
    for p, name, is_sparse in zip(params, names, sparse):
        used = per_device.get(p.device.type, backend)
        if is_sparse and used != "gloo":
            raise ValueError(
                f"parameter {name!r} gets sparse gradients (nn.Embedding/EmbeddingBag with sparse=True) on "
                f"{p.device.type}, where the process group's backend is {used!r}: only gloo can all-reduce "
                "sparse tensors. Use sparse=False, or a gloo process group.")


# ---- bucket_cap_mb="auto" -------------------------------------------------------------------------

CANDIDATE_CAPS_MB = (1, 5, 25, 100)
STEPS = 5  # timed steps per visit of a candidate (after one untimed step)
ROUNDS = 2  # visits per candidate: in order, then in reverse (drift of the machine hits all alike)


class AutoCap:
    """bucket_cap_mb="auto": time a few bucket caps during the first iterations, keep the fastest.

    Which cap is fastest depends on the model, the batch, the machine and the network: small buckets
    start communicating early (more overlap with backward) but pay a fixed cost per collective; large
    ones pay it rarely but start late. Horovod's autotune measures its fusion buffer size the same way;
    torch DDP has no such thing (its default, 25 MiB with a 1 MiB first bucket, is one of the candidates
    here in spirit: 1 and 25 are both tried).

    How, as the reducer runs it (Reducer.maybe_rebuild, before each forward that may sync):
      * the first iteration runs as torch DDP's does (one bucket, or the construction layout with
        find_unused_parameters); from the next forward on, each candidate cap in turn lays out the
        buckets (`plan_for(cap)`: the layout torch DDP would use with that cap) for one untimed step
        (fresh buffers) and STEPS timed ones; ROUNDS rounds, the second in reverse order (A B C C B A),
        and each candidate's median over all its timed steps counts;
      * candidates whose layout equals an earlier candidate's are skipped (the same buckets run the same);
      * a step is the time between two forwards that follow completed synced iterations, so it holds
        forward, backward, the communication left at its end, and the optimizer step;
      * when every candidate has been timed, each rank takes rank 0's fastest (a broadcast: one
        decision, so every rank's buckets stay the same), and the layout stays for the rest of training.
    Every rank switches at the same completed-iteration count (failed iterations do not count, on any
    rank), so the ranks' layouts change together. Rank 0's clock decides; the broadcast is the reducer's.

    Args:
        candidates: bucket caps to try, in MiB. Default None: CANDIDATE_CAPS_MB (read when built).
        steps: timed steps per candidate. Default None: STEPS.
    """

    def __init__(self, candidates=None, steps: int | None = None):
        self.candidates = list(CANDIDATE_CAPS_MB if candidates is None else candidates)
        self.steps = STEPS if steps is None else steps
        self.index = 0             # the candidate being timed
        self._schedule, self._visit = [], 0  # candidate indices to visit in turn, and where we are
        self.chosen = None         # the cap adopted for good (None while tuning)
        self.step_times = {}       # cap -> this rank's timed step seconds
        self._stamps = []          # clock readings at this candidate's step boundaries
        self._seen = None          # the reducer's completed count at the last call
        self._distinct = None      # candidates left after dropping repeated layouts

    @property
    def cap(self) -> float:
        """The cap in use now: the candidate being timed, or the chosen one."""
        return self.chosen if self.chosen is not None else self.candidates[self.index]

    def step(self, completed: int, plan_for) -> float | None:
        """Called before every forward that may sync: the cap to use from this forward on, or None
        once every candidate has been timed (the caller then adopts rank 0's `fastest()`).

        Args:
            completed: iterations completed on every rank so far (the reducer's count).
            plan_for: cap -> bucket layout (to skip candidates that lay out the same buckets).
        """
        if self.chosen is not None or completed == self._seen:
            return self.cap  # decided, or no iteration finished since the last call (no_sync, eval)
        self._seen = completed
        if self._distinct is None:
            self._start(plan_for)
            if len(self._distinct) == 1:
                return None  # every candidate lays out the same buckets: nothing to time
        self._stamps.append(time.perf_counter())
        if len(self._stamps) < self.steps + 2:  # one untimed step, then `steps` timed ones
            return self.cap
        self.step_times.setdefault(self.cap, []).extend(b - a for a, b in zip(self._stamps[1:], self._stamps[2:]))
        self._visit += 1
        if self._visit == len(self._schedule):
            return None
        self.index = self._schedule[self._visit]
        self._stamps = [time.perf_counter()]
        return self.cap

    def medians(self) -> dict:
        """This rank's median step seconds per timed cap."""
        return {cap: sorted(t)[len(t) // 2] for cap, t in self.step_times.items()}

    def _start(self, plan_for) -> None:
        plans, self._distinct = [], []
        for i, cap in enumerate(self.candidates):
            plan = plan_for(cap)
            if plan not in plans:
                plans.append(plan)
                self._distinct.append(i)
        self._schedule = [i for r in range(ROUNDS) for i in (self._distinct[::-1] if r % 2 else self._distinct)]
        self.index = self._schedule[0]

    def fastest(self) -> int:
        """The index (into candidates) of the cap with this rank's shortest median step."""
        medians = self.medians()
        if not medians:  # a single distinct layout
            return self._distinct[0]
        return self.candidates.index(min(medians, key=medians.get))
