"""ZeroRedundancyOptimizer(reduce_scatter=True) with hook_with_zero_reduce_scatter: ZeRO-1 that
sends what DDP sends (the ZeRO paper's stage 1; Megatron-LM's distributed optimizer).

Plain ZeRO-1 (optimizer.py, and torch's) lets DDP all-reduce every gradient, steps its shard, then
broadcasts it: 3(N-1)/N of the parameters sent by a rank each step, against DDP's 2(N-1)/N. Here
DDP's all-reduce is replaced, through its comm hook, by a reduce-scatter: each rank receives the
averaged gradients of its shard only, steps them, and an all-gather gives every rank the updated
weights: (N-1)/N + (N-1)/N, DDP's bytes.

The shard is Megatron's, not the plain partition's: the trainable parameters, in the optimizer's
order, are cut into shard buckets of about `bucket_cap_mb` (whole parameters); each bucket's weights
live in one flat buffer (parameters are views into it), padded to N equal chunks, and rank r steps
chunk r of every bucket. A parameter may straddle two ranks: each steps its piece (a view of the
flat buffer) with the same element-wise arithmetic, so SGD and Adam(W) end bitwise as the plain
step. An optimizer that reads a whole tensor (LARS's or LAMB's norms, Adafactor's row and column
factors, L-BFGS) would compute over a piece: torch's optimizers that do are refused, any other
class is warned about (ELEMENT_WISE). The layout is fixed when the hook is made, whatever DDP's
buckets do (they are rebuilt after the first step); parameter groups may be added until then.
Checkpoints: the state of a parameter's pieces is joined into a plain optimizer's on the
consolidating rank and cut again on load (state_dicts.merge_pieces, split_pieces), so a
checkpoint moves to and from plain ZeRO-1, torch's ZeroRedundancyOptimizer and other world sizes.

A step:
  backward  the hook copies each DDP bucket's gradients into the shard buckets' flat gradients; a
            shard bucket whose gradients are all in is scaled by 1/N and reduce-scattered (async),
            the last-defined buckets first, every rank in the same order; DDP gets its buffer back
            untouched, so `.grad` holds this rank's own (unreduced) gradient
  step()    waits for the reduce-scatters, steps this rank's pieces, starts one all-gather per
            bucket; waits for them, or (overlap_param_gather=True) leaves them to the next forward,
            where each module waits, in a forward pre-hook, only for the buckets of its own weights
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...validate import check_bool, check_number
from . import state_dicts
from .overlap import record, timeline_of

# The timeline's lanes (overlap.record): a collective's span ends when the host waits for it (gloo's
# reduce-scatter and all-gather works have no future to call back from).
SCATTER_LANE, GATHER_LANE, WAIT_LANE = "ZeRO: reduce-scatter", "ZeRO: all-gather", "ZeRO: waits"

# torch's optimizers whose step is element by element: stepping a piece of a tensor is stepping the
# tensor. Those that read a whole tensor are refused; any other class (a subclass too: it may
# override step) gets a warning.
ELEMENT_WISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD",
    "Rprop") if hasattr(torch.optim, name))
WHOLE_TENSOR = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "SparseAdam")
                     if hasattr(torch.optim, name))


def check_element_wise(optimizer_class) -> None:
    """Refuse torch's optimizers that read whole tensors; warn about a class not known to be
    element-wise (LARS, LAMB: a norm over a piece is not the tensor's)."""
    if issubclass(optimizer_class, WHOLE_TENSOR):
        raise ValueError(f"reduce_scatter=True steps pieces of parameters; optimizer_class="
                         f"{optimizer_class.__name__} reads whole tensors: use the plain "
                         "ZeroRedundancyOptimizer (reduce_scatter=False)")
    if optimizer_class not in ELEMENT_WISE:  # a subclass may step otherwise (LARS over SGD)
        warnings.warn(f"reduce_scatter=True steps pieces of parameters (a parameter may straddle two "
                      f"ranks); optimizer_class={optimizer_class.__name__} is not one of torch's "
                      "element-wise optimizers: its step must be element-wise (a norm over a whole "
                      "tensor, as LARS or LAMB take, would be a piece's)", stacklevel=4)


class Piece(NamedTuple):
    """Elements [lo, hi) of a flattened parameter that this rank steps: `weights` is their view of
    the shard bucket's flat weights (what the local optimizer holds), `grad` of its shard_grad."""
    param: torch.Tensor
    weights: torch.Tensor
    grad: torch.Tensor
    lo: int
    hi: int


def plan_shard_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive indices into `sizes` (element counts), cut before one would pass `cap` elements;
    every bucket holds one at least. Pure: every rank gets the same answer."""
    buckets, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > cap:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    return buckets + [current] if current else buckets


def cut_pieces(offset: int, numel: int, chunk: int, world_size: int) -> list[tuple[int, int, int]]:
    """(rank, lo, hi): the elements [lo, hi) of a parameter at `offset` of a bucket that rank steps,
    chunk r of the bucket being [r * chunk, (r + 1) * chunk)."""
    pieces = []
    for rank in range(world_size):
        lo, hi = max(offset, rank * chunk), min(offset + numel, (rank + 1) * chunk)
        if lo < hi:
            pieces.append((rank, lo - offset, hi - offset))
    return pieces


class ShardBucket:
    """Some consecutive parameters' weights and gradients in two flat buffers of N equal chunks.

    Args:
        params: the parameters, in order; their `.data` becomes views of `flat`.
        world_size, rank: of the optimizer's process group.
    """

    def __init__(self, params: list, world_size: int, rank: int):
        self.params = params
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        total = self.offsets.pop()
        self.chunk = math.ceil(total / world_size)
        first = params[0]
        self.flat = torch.zeros(self.chunk * world_size, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.flat)  # the padding stays zero
        self.shard_grad = torch.empty(self.chunk, dtype=first.dtype, device=first.device)
        self.mine = slice(rank * self.chunk, (rank + 1) * self.chunk)
        for p, offset in zip(params, self.offsets):
            view = self.flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view  # the weight's storage is now the bucket's (contiguous)

    def grad_view(self, slot: int) -> torch.Tensor:
        """Where parameter `slot`'s gradient goes, shaped like it."""
        p, offset = self.params[slot], self.offsets[slot]
        return self.grads[offset:offset + p.numel()].view_as(p)


class ReduceScatterStep:
    """reduce_scatter=True: the policy ZeroRedundancyOptimizer holds (`zero._stepping`), and the
    hook's state: the shard buckets, this rank's pieces, the collectives in flight.

    Args:
        optimizer_class: the local optimizer's class, built over this rank's pieces by the hook.
    """

    def __init__(self, optimizer_class):
        check_element_wise(optimizer_class)
        self.optimizer_class = optimizer_class
        self.buckets: list[ShardBucket] = []
        self.where: dict = {}  # parameter -> (shard bucket, slot)
        self.pieces: list[Piece] = []  # this rank's, in its local optimizer's order
        self.pending: list[int] = []  # per shard bucket: gradients still to come this backward
        self.scatters: list = []  # this backward's reduce-scatters, in launch order
        self.gathers: dict[int, object] = {}  # shard bucket -> its all-gather's work, in flight
        self.world_size = self.rank = 0
        self.reduced = False  # a backward reduce-scattered since the last step
        self.timeline_of = lambda: None
        self.pre_hooks: list = []

    # -- what ZeroRedundancyOptimizer asks its policy ---------------------------------------------

    def steps_in_step(self) -> bool:
        """step() steps once backward's reduce-scatters are in (it waits for them here)."""
        self.check_built()
        if not self.reduced:
            raise RuntimeError("ZeroRedundancyOptimizer(reduce_scatter=True).step(): no gradient "
                               "was reduce-scattered since the last step; run loss.backward() on "
                               "the DDP model that has hook_with_zero_reduce_scatter(model, zero) "
                               "registered as its comm hook first")
        timeline = self.timeline_of()
        for work, name in self.scatters:
            work.wait()  # ranks met there: this rank's shard of the averaged gradients is here
            record(timeline, "end", SCATTER_LANE, name)
        self.scatters.clear()
        self.reduced = False
        for piece in self.pieces:
            # a parameter no rank used keeps .grad None: skipped, as a plain optimizer skips it
            piece.weights.grad = None if piece.param.grad is None else piece.grad
        return True

    def share_shards(self, zero) -> None:
        """After the local step: one all-gather per shard bucket, forward order; waited for now,
        or by the next forward (overlap_param_gather)."""
        timeline = self.timeline_of()
        for k, bucket in enumerate(self.buckets):
            name = f"all-gather bucket {k}"
            record(timeline, "begin", GATHER_LANE, name)
            # ranks meet here: every rank sends its chunk and receives the others'
            work = dist.all_gather_single(bucket.flat, bucket.flat[bucket.mine].clone(),
                                               group=zero.process_group, async_op=True)
            self.gathers[k] = (work, name)
        if not self.pre_hooks:
            self.wait_gathers(range(len(self.buckets)))

    def check_add_param_group(self) -> bool:
        """Before the hook: the group is taken as it is (the hook's layout takes every group)."""
        if self.buckets:
            raise RuntimeError("ZeroRedundancyOptimizer with `reduce_scatter=True` does not support "
                               "add_param_group() once hook_with_zero_reduce_scatter is made: the "
                               "shard layout is fixed then; add the group before making the hook")
        return False

    def check_built(self) -> None:
        """Raise unless the hook was made (it makes the layout and the local optimizer)."""
        if not self.buckets:
            raise RuntimeError("ZeroRedundancyOptimizer(reduce_scatter=True): make its comm hook "
                               "first, model.register_comm_hook(None, "
                               "hook_with_zero_reduce_scatter(model, zero))")

    def check_ready(self) -> None:
        """The checkpoint methods need the layout, which the hook makes."""
        self.check_built()

    # -- checkpoints: a plain optimizer's format, whatever the pieces -----------------------------

    def local_state_dict(self, zero) -> dict:
        """What this rank sends to the consolidating rank: its pieces, numbered globally, with the
        local optimizer's state of each."""
        number = {p: i for i, p in enumerate(p for g in zero.param_groups for p in g["params"])}
        return {"pieces": [(number[piece.param], piece.lo, piece.hi) for piece in self.pieces],
                "state": zero.optim.state_dict()["state"]}

    def merge_state_dicts(self, zero, base: dict, gathered: list) -> dict:
        return state_dicts.merge_pieces(base, gathered, zero.param_groups)

    def load_state(self, zero, state: dict) -> None:
        pieces = [(piece.param, piece.weights, piece.lo, piece.hi) for piece in self.pieces]
        for weights, value in state_dicts.split_pieces(state, zero.param_groups, pieces).items():
            zero.optim.state[weights] = value

    # -- the layout, made once by the hook --------------------------------------------------------

    def build(self, zero, cap: int, order: list) -> None:
        """Shard buckets over zero's trainable parameters in the model's order (`order`: the
        forward's, roughly), and the local optimizer over this rank's pieces (one local group per
        group of zero, empty or not)."""
        self.world_size, self.rank = zero.world_size, zero.rank
        groups = [[p for p in g["params"] if p.requires_grad] for g in zero.param_groups]
        held = {p for g in groups for p in g}
        params = [p for p in dict.fromkeys(order) if p in held]  # tied: once
        if not params:
            raise ValueError("hook_with_zero_reduce_scatter: zero holds no parameter that "
                             "requires grad")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"hook_with_zero_reduce_scatter: zero's parameters are on {devices}; "
                             "reduce_scatter=True needs them on one device")
        plan = plan_shard_buckets([p.numel() for p in params], cap)
        self.buckets = [ShardBucket([params[i] for i in idx], self.world_size, self.rank)
                        for idx in plan]
        self.where = {p: (k, slot) for k, b in enumerate(self.buckets)
                      for slot, p in enumerate(b.params)}
        shards = [[] for _ in range(self.world_size)]
        for group, members in zip(zero.param_groups, groups):
            per_rank = [[] for _ in range(self.world_size)]
            for p in dict.fromkeys(members):
                k, slot = self.where[p]
                bucket = self.buckets[k]
                offset = bucket.offsets[slot]
                for rank, lo, hi in cut_pieces(offset, p.numel(), bucket.chunk, self.world_size):
                    piece = bucket.flat[offset + lo:offset + hi]
                    per_rank[rank].append(piece)
                    if rank == self.rank:
                        start = offset + lo - bucket.mine.start
                        grad = bucket.shard_grad[start:start + hi - lo]
                        self.pieces.append(Piece(p, piece, grad, lo, hi))
            for rank in range(self.world_size):
                shards[rank].append(dict(group, params=per_rank[rank]))
        zero._shard(shards, self.optimizer_class, zero._optim_defaults)
        self.pending = [len(b.params) for b in self.buckets]

    # -- backward: every DDP bucket ----------------------------------------------------------------

    def reduce_bucket(self, bucket, group) -> torch.futures.Future:
        """The comm hook's work for one DDP bucket: its gradients into the shard buckets, and the
        reduce-scatter of every shard bucket now complete. DDP gets its buffer back as it is."""
        if bucket.index() == 0:
            self.wait_gathers(list(self.gathers))  # weights no forward waited for (unused ones)
        params, grads = bucket.parameters(), bucket.gradients()
        unknown = [i for i, p in enumerate(params) if p not in self.where]
        if unknown:
            raise RuntimeError(f"hook_with_zero_reduce_scatter: DDP bucket {bucket.index()} holds "
                               f"{len(unknown)} parameter(s) that the ZeroRedundancyOptimizer does "
                               "not hold; give zero every trainable parameter of the model")
        dsts = [self.buckets[self.where[p][0]].grad_view(self.where[p][1]) for p in params]
        torch._foreach_copy_(dsts, grads)
        for p in params:
            self.pending[self.where[p][0]] -= 1
        self.launch_ready(group)
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def launch_ready(self, group) -> None:
        """Reduce-scatter the complete shard buckets, last first, stopping at the first incomplete
        one: every rank launches the same sequence (DDP calls the hook in bucket order)."""
        timeline = self.timeline_of()
        reciprocal = 1.0 / self.world_size  # DDP's numerics: times 1/N, then sum
        for k in reversed(range(len(self.buckets) - len(self.scatters))):
            if self.pending[k] != 0:
                break
            bucket = self.buckets[k]
            bucket.grads.mul_(reciprocal)
            name = f"reduce-scatter bucket {k}"
            record(timeline, "begin", SCATTER_LANE, name)
            # ranks meet here: each receives the sum of its chunk
            work = dist.reduce_scatter_single(bucket.shard_grad, bucket.grads, group=group,
                                              async_op=True)
            self.scatters.append((work, name))
        if len(self.scatters) == len(self.buckets):  # the whole model is on its way
            self.pending = [len(b.params) for b in self.buckets]
            self.reduced = True

    # -- the next forward -------------------------------------------------------------------------

    def wait_gathers(self, indices, who: str = "") -> None:
        """Wait for the all-gathers of shard buckets `indices` still in flight."""
        timeline = self.timeline_of()
        for k in indices:
            work, gather = self.gathers.pop(k, (None, None))
            if work is not None:
                name = f"{who} waits for bucket {k}".strip()
                record(timeline, "begin", WAIT_LANE, name)
                work.wait()
                record(timeline, "end", WAIT_LANE, name)
                record(timeline, "end", GATHER_LANE, gather)

    def watch_forward(self, module) -> None:
        """overlap_param_gather: each submodule waits, before its forward, for its own weights."""
        for name, sub in module.named_modules():
            mine = sorted({self.where[p][0] for p in sub.parameters(recurse=False)
                           if p in self.where})
            if mine:
                hook = sub.register_forward_pre_hook(
                    lambda _m, _x, k=mine, n=name or "module": self.wait_gathers(k, n))
                self.pre_hooks.append(hook)


def hook_with_zero_reduce_scatter(ddp, zero, bucket_cap_mb: float = 25.0,
                                  overlap_param_gather: bool = False):
    """The comm hook by which `zero` (reduce_scatter=True) reduce-scatters in DDP's place.

    Args:
        ddp: the DDP model (minidp.DDP; torch DDP works too, without a timeline).
        zero: a minidp.ZeroRedundancyOptimizer built with reduce_scatter=True over the model's
            trainable parameters, on DDP's process group.
        bucket_cap_mb: the size of a shard bucket (one reduce-scatter and one all-gather each).
            Default 25, DDP's.
        overlap_param_gather: leave step()'s all-gathers in flight; each module of the next forward
            waits for its own weights (Megatron's name). Default False: step() returns with every
            weight updated, as torch's ZeroRedundancyOptimizer.
    Returns:
        The hook: ddp.register_comm_hook(None, hook_with_zero_reduce_scatter(ddp, zero)).
    """
    if not getattr(zero, "_reduce_scatter", False):
        raise ValueError("hook_with_zero_reduce_scatter: zero must be a "
                         "minidp.ZeroRedundancyOptimizer constructed with `reduce_scatter=True`, "
                         f"got {type(zero).__name__}")
    cap_mb = check_number("bucket_cap_mb", bucket_cap_mb, positive=True)
    overlap = check_bool("overlap_param_gather", overlap_param_gather)
    module = getattr(ddp, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"hook_with_zero_reduce_scatter: ddp must be a DDP model (with a .module), "
                        f"got {type(ddp).__name__}")
    stepping = zero._stepping
    if stepping.buckets:
        raise RuntimeError("hook_with_zero_reduce_scatter: this ZeroRedundancyOptimizer has its "
                           "hook already; make one per optimizer")
    model_params = list(module.parameters())
    if any(p not in set(model_params) for g in zero.param_groups for p in g["params"]):
        raise ValueError("hook_with_zero_reduce_scatter: zero holds a parameter that is not "
                         "ddp's module's")
    itemsize = next(p for g in zero.param_groups for p in g["params"]).element_size()
    stepping.build(zero, max(1, int(cap_mb * 2**20) // itemsize), model_params)
    stepping.timeline_of = lambda: timeline_of(ddp)
    if overlap:
        stepping.watch_forward(module)
    group = zero.process_group

    def reduce_scatter_fn(state, bucket):
        return stepping.reduce_bucket(bucket, group)

    return reduce_scatter_fn
