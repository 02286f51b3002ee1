"""minidp.fully_shard against torch's FSDP2 fully_shard, the oracle: same shards, weights, traffic.

One launch per world size (1-4): each rank builds the same model twice (two residual blocks,
each its own unit, then the root over an input layer and a head), shards it with minidp's
fully_shard and with torch's, trains both on the same batches, and returns plain results; the tests
below only compare them. Layer sizes are odd (7, 15, 11, 3 rows): at 2 and 4 ranks every shard
is padded, at 3 all but the 15- and 3-row ones, and at 4 one rank holds no row of the head. Four
ranks on two cores make every collective slow, so each case names the world sizes it runs at.
The HSDP cases run on a 2-D mesh of 2 replicas of W/2 ranks (at 2 ranks, 2 replicas of one rank:
the all-reduce alone); the int reshard_after_forward one on 4 ranks (2: backward gathers within
pairs).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_flatten

import minidp
from harness import error_of, run_ranks
from minidp.engine.timeline import named_spans
from minidp.sharded.fsdp.state import state_of
from training import rank_batches

STEPS = 20
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
}
ENGINES = {"minidp": minidp.fully_shard, "torch": torch_fully_shard}


NO_MP = MixedPrecisionPolicy()
IGNORED = "blocks.1.down.bias"  # in the tied case: fully_shard(..., ignored_params={it})


class Case(NamedTuple):
    optim: str
    reshard: bool | None = True  # reshard_after_forward (None: FSDP2's default, the root keeps)
    clip: bool = False  # clip_grad_norm_(max_norm=0.05) before every step (the test: it clips)
    accumulate: int = 1  # micro-batches a step; the first without gradient sync
    mp: MixedPrecisionPolicy = NO_MP
    # TiedNet: a tied weight (its two layers one unit, fully_shard([a, b])), a block run twice,
    # an unused layer; IGNORED not sharded
    tied: bool = False
    # explicit prefetch, out of the default order: the root starts block 1's gather in forward
    # (before block 0's) and block 0's in backward (before block 1's)
    prefetch: bool = False
    mesh: str = "flat"  # "hsdp": the 2-D mesh (replicate, shard)
    all_reduce_last: bool = False  # HSDP accumulation: reduce-scatter each micro-batch,
    # all-reduce on the last only (set_requires_all_reduce); gradient sync stays on
    placement: bool = False  # shard_placement_fn: Shard(1) where dim 1 divides evenly, else dim 0
    offload: bool = False  # CPUOffloadPolicy(pin_memory=False)
    worlds: tuple = (1, 2, 3)  # the world sizes it runs at


CASES = {
    "adamw": Case("adamw", worlds=(1, 2, 3, 4)),
    "adamw-keep": Case("adamw", reshard=False, worlds=(1, 2)),
    # fp16 compute and reduction: FSDP2 divides by 2 before the SUM and by the rest after it
    "sgd-fp16": Case("sgd", mp=MixedPrecisionPolicy(param_dtype=torch.float16,
                                                    output_dtype=torch.float32)),
    "sgd-keep-clip": Case("sgd", reshard=False, clip=True, worlds=(1, 2, 3, 4)),
    "adamw-tied-unused-keep": Case("adamw", reshard=False, tied=True),
    "adamw-default-accumulate": Case("adamw", reshard=None, accumulate=2, prefetch=True, worlds=(1, 2)),
    # bf16 weights in forward and backward, fp32 shards, optimizer and reduction
    "adamw-bf16-fp32": Case("adamw", mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32),
                            worlds=(1, 2)),
    # ... and the unsynced micro-batch's bf16 gradients kept in fp32
    "sgd-bf16-fp32-accumulate": Case("sgd", accumulate=2, mp=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32), worlds=(1, 2)),
    # all in bf16 but the shards: the reduce-scatter too; the root's outputs cast to fp32
    "sgd-bf16-keep": Case("sgd", reshard=False, mp=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, output_dtype=torch.float32), worlds=(1, 2)),
    "adamw-hsdp": Case("adamw", mesh="hsdp", worlds=(2, 4)),
    "sgd-hsdp-accumulate": Case("sgd", mesh="hsdp", accumulate=2, all_reduce_last=True,
                                worlds=(2, 4)),
    "adamw-hsdp-bf16-keep": Case("adamw", mesh="hsdp", reshard=False, mp=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32), worlds=(2,)),
    "adamw-reshard-to-2": Case("adamw", reshard=2, worlds=(4,)),
    "adamw-shard-dim-1": Case("adamw", placement=True, worlds=(2,)),
    "sgd-offload-accumulate": Case("sgd", offload=True, accumulate=2, worlds=(2,)),
}


class Block(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """An input layer and a head (the root's unit) around two blocks (a unit each)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 7)
        self.blocks = nn.ModuleList([Block(7, 15), Block(7, 11)])  # sizes tell them apart
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class TiedNet(Net):
    """Net, and in the root's unit two layers sharing a weight, and a layer forward never uses;
    block 0 runs twice (its unit gathers and reduces twice in one step)."""

    def __init__(self):
        super().__init__()
        self.mix, self.mix2, self.unused = nn.Linear(7, 7), nn.Linear(7, 7), nn.Linear(7, 7)
        self.mix2.weight = self.mix.weight

    def forward(self, x):
        h = self.inp(self.mix2(torch.tanh(self.mix(self.inp(x)))) @ self.inp.weight)
        for block in (self.blocks[0], self.blocks[1], self.blocks[0]):
            h = block(h)
        return self.head(h)


def _dim_1_where_even(param):
    """A shard_placement_fn: Shard(1) where dim 1 divides over the world (FSDP2 needs it even)."""
    even = param.dim() > 1 and param.size(1) % dist.get_world_size() == 0
    return Shard(1) if even else None


def _sharded(engine, mesh, reshard, mp_policy=NO_MP, tied=False, placement=False, offload=False):
    torch.manual_seed(0)
    net = TiedNet() if tied else Net()
    more = {}
    if placement:
        more["shard_placement_fn"] = _dim_1_where_even
    if offload:
        more["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in net.blocks:
        # output_dtype on the root only: a block's fp32 output would meet the root's bf16 head
        ignored = {block.down.bias} if tied and block is net.blocks[1] else None
        ENGINES[engine](block, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored,
                        mp_policy=dataclasses.replace(mp_policy, output_dtype=None), **more)
    if tied:  # the two layers that share a weight: one unit for a list of modules, gathered
        # before the first runs and freed after the second
        ENGINES[engine]([net.mix, net.mix2], mesh=mesh, reshard_after_forward=True)
    return ENGINES[engine](net, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                           **more)


def _layout(net):
    """What each rank holds: each parameter's type, placements, global and local shape, strides."""
    return {name: (type(p).__name__, tuple(getattr(p, "placements", ())), tuple(p.shape),
                   tuple(_local(p).shape), _local(p).stride())
            for name, p in net.named_parameters()}


def _kinds(net):
    """Which parameters the module holds now: "shard" (the DTensor) or "full" (the gathered one)."""
    return ["shard" if isinstance(p, DTensor) else "full" for p in net.parameters()]


def _held(net):
    """Bytes of gathered parameters minidp holds now, unit by unit (blocks first, the root last)."""
    units = [state_of(m).unit for m in (*net.blocks, net)]
    return [sum(p.full.untyped_storage().nbytes() for p in unit.params) for unit in units]


def _tracing(in_flight=None):
    """Patch torch.distributed's all_gather_single / reduce_scatter_single / all_reduce (both
    engines call them through the module) to record each call as (collective, its output's numel),
    in the order they are issued; with `in_flight` (returns minidp's list of reduce-scatters in flight) each
    reduce-scatter is followed by ("in flight before", how many were in flight as it started).
    Returns (trace, patches)."""
    trace = []

    def traced(name, real):
        def call(*args, **kwargs):
            output = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            trace.append((name, output.numel()))
            if in_flight is not None and name == "reduce_scatter":
                trace.append(("in flight before", len(in_flight())))
            return real(*args, **kwargs)
        return call

    return trace, (mock.patch.object(dist, "all_gather_single",
                                     traced("all_gather", dist.all_gather_single)),
                   mock.patch.object(dist, "reduce_scatter_single",
                                     traced("reduce_scatter", dist.reduce_scatter_single)),
                   mock.patch.object(dist, "all_reduce", traced("all_reduce", dist.all_reduce)))


def _train(engine, case, mesh, rank):
    net = _sharded(engine, mesh, case.reshard, case.mp, case.tied, case.placement, case.offload)
    if case.prefetch:
        net.set_modules_to_forward_prefetch([net.blocks[1]])
        net.set_modules_to_backward_prefetch([net.blocks[0]])
    optimizer_class, defaults = OPTIMIZERS[case.optim]
    opt = optimizer_class(net.parameters(), **defaults)
    out = {"layout": _layout(net), "kinds": [], "losses": []}
    in_flight = (lambda: state_of(net).root.reduces.pending) if engine == "minidp" else None
    trace, patches = _tracing(in_flight)
    timeline = net.enable_timeline() if engine == "minidp" else None
    for step, batches in enumerate(_grouped(rank_batches(STEPS * case.accumulate, rank,
                                                         targets=(4, 3)), case.accumulate)):
        for k, (x, y) in enumerate(batches):
            if case.all_reduce_last:
                net.set_requires_all_reduce(k == len(batches) - 1)
            else:
                net.set_requires_gradient_sync(k == len(batches) - 1)
            with patches[0], patches[1], patches[2]:
                output = net(x)
                loss = F.mse_loss(output.float(), y)
                if step == 0:
                    out["output_dtype"] = output.dtype
                    out["kinds"].append(_kinds(net))  # after forward
                    out["held"] = [_held(net)] if engine == "minidp" else None
                loss.backward()
            if step == 0:
                out["kinds"].append(_kinds(net))  # after backward
                if engine == "minidp":
                    out["held"].append(_held(net))
                out["trace"] = list(trace)
                if timeline is not None:  # (lane, unit, duration >= 0) of each collective
                    out["spans"] = [(lane, name, end >= begin) for lane, name, begin, end
                                    in named_spans(timeline.snapshot())]
            out["losses"].append(loss.detach())
        if case.clip:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
            out.setdefault("norms", []).append(norm.full_tensor())  # a replicated DTensor
        if step == STEPS - 1:
            out["grads"] = [p.grad if p.grad is None else _local(p.grad).clone()
                            for p in net.parameters()]
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # an evaluation: reshard_after_forward=False keeps the weights gathered
        net(x)
    out["state_dict"] = {k: type(v).__name__ for k, v in net.state_dict().items()}  # DTensors
    out["full"] = {name: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
                   for name, p in net.named_parameters()}
    net.blocks[1].unshard()
    out["unshard"] = (_kinds(net), net.blocks[1].up.weight.detach().clone())
    net.blocks[1].reshard()
    out["reshard"] = _kinds(net)
    return out


def _local(t):
    """This rank's part of a DTensor, or a plain tensor itself (an ignored parameter's)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _grouped(batches, size):
    return [batches[i:i + size] for i in range(0, len(batches), size)]


def _bad_input(mesh):
    """(case, minidp's error, torch's error) for inputs FSDP2 refuses, errors as (type, message)."""
    out = {}
    net = Net()
    minidp.fully_shard(net, mesh=mesh)
    twice = torch_fully_shard(Net(), mesh=mesh)
    out["twice"] = (error_of(minidp.fully_shard, net, mesh=mesh),
                    error_of(torch_fully_shard, twice, mesh=mesh))
    listing = nn.ModuleList([nn.Linear(2, 2)])
    out["container"] = (error_of(minidp.fully_shard, listing, mesh=mesh),
                        error_of(torch_fully_shard, nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh))
    transposed = [nn.Linear(4, 6) for _ in range(2)]
    for layer in transposed:
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())
    out["non-contiguous"] = (error_of(minidp.fully_shard, transposed[0], mesh=mesh),
                             error_of(torch_fully_shard, transposed[1], mesh=mesh))
    world = dist.get_world_size()
    cube = init_device_mesh("cpu", (1, 1, world))
    unnamed = init_device_mesh("cpu", (1, world))
    for case, kwargs in {"3-D mesh": {"mesh": cube}, "2-D mesh without names": {"mesh": unnamed},
                         "reshard int not a factor": {"reshard_after_forward": world + 1},
                         "reshard str": {"reshard_after_forward": "yes"}}.items():
        kwargs = {"mesh": mesh, **kwargs}
        out[case] = (error_of(minidp.fully_shard, Net(), **kwargs),
                     error_of(torch_fully_shard, Net(), **kwargs))
    early = Net()  # an optimizer built before fully_shard holds the replaced parameters
    before = torch.optim.AdamW(early.parameters())
    minidp.fully_shard(early, mesh=mesh)
    after = torch.optim.SGD(early.parameters())  # built after: it steps (no gradients yet)
    out["optimizer before"] = (error_of(before.step), error_of(after.step))
    return out


def _checkpoint(src, dst, mesh, rank, folder):
    """`src` trains 3 steps and saves its model and AdamW state with torch.distributed.checkpoint;
    `dst`, after 2 steps of its own on other data, loads them; both take one more step. Returns
    both engines' full weights and optimizer states after it."""
    batches = rank_batches(4, rank, targets=(4, 3))
    ends = {}
    for engine, own in ((src, batches[:3]), (dst, rank_batches(2, rank, seed=9, targets=(4, 3)))):
        net = _sharded(engine, mesh, True)
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        for x, y in own:
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        ends[engine] = net, opt
    dcp.save(_states(*ends[src]), checkpoint_id=folder)
    loaded = _states(*ends[dst])
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(*ends[dst], model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    for net, opt in ends.values():
        F.mse_loss(net(batches[3][0]), batches[3][1]).backward()
        opt.step()
    full = StateDictOptions(full_state_dict=True)
    return {engine: get_state_dict(net, opt, options=full) for engine, (net, opt) in ends.items()}


def _deferred_init(mesh, rank):
    """FSDP2's deferred init: a model made on the meta device, sharded, materialised with
    to_empty(), initialised by reset_parameters() (DTensor's random ops), then trained 3 steps.
    Returns each engine's full weights."""
    out = {}
    for engine, shard in ENGINES.items():
        with torch.device("meta"):
            net = Net()
        for block in net.blocks:
            shard(block, mesh=mesh)
        shard(net, mesh=mesh).to_empty(device="cpu")
        torch.manual_seed(1)
        for module in net.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        for x, y in rank_batches(3, rank, targets=(4, 3)):
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[engine] = {name: p.full_tensor() for name, p in net.named_parameters()}
    return out


def _states(net, opt):
    model, optim = get_state_dict(net, opt)
    return {"model": model, "optim": optim}


def _default_mesh():
    """What a fully_shard without mesh= shards over: (device type, mesh shape, placements)."""
    out = {}
    for engine, shard in ENGINES.items():
        weight = shard(nn.Linear(3, 5)).weight
        out[engine] = (weight.device_mesh.device_type, weight.device_mesh.shape, weight.placements)
    return out


def _hang(rank):
    """Rank 1 skips a forward: rank 0's all-gather times out (a group with a 1 s timeout), and its
    error names rank 1 (minidp's watchdog). Returns rank 0's error as (type, message)."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    net = _sharded("minidp", DeviceMesh.from_group(group, "cpu"), True)
    x = torch.randn(4, 8)
    net(x).sum().backward()
    if rank == 1:
        time.sleep(2)  # alive, elsewhere, past rank 0's timeout
        return None
    return error_of(net, x)


class MLP(nn.Module):
    """torch's common_fsdp MLP: in_proj's rows (mult x dim) are cut by TP, then by FSDP, unevenly."""

    def __init__(self, dim, mult):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, mult * dim), nn.Linear(mult * dim, dim)

    def forward(self, x):
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


# (mlp dim, reshard_after_forward, activation checkpointing, sequence parallel); dim 5: in_proj's 15
# rows are 8 and 7 a TP rank, then 4 + 4 and 4 + 3 a DP rank (uneven twice); dim 16: even everywhere.
# Sequence parallel adds a LayerNorm whose weight is replicated over TP, its gradient a Partial sum.
TP_CASES = [(5, True, True, False), (16, False, False, True)]
TP_STEPS = 10


def _tensor_parallel(engine, dim, reshard, checkpointing, sequence_parallel, rank):
    """FSDP over TP on a 2 x 2 mesh (dp, tp), torch's MLPStack test: Colwise/Rowwise parallel MLPs,
    each its own unit, then the root (with the LayerNorm, under sequence parallelism); Adam, 10 steps
    (torch's test's count; the suite's time)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(42)
    net = nn.Sequential(MLP(dim, 3), MLP(dim, 4), MLP(dim, 3))
    plan = {}
    for i in range(3):
        plan[f"{i}.in_proj"] = ColwiseParallel(use_local_output=False)
        plan[f"{i}.out_proj"] = RowwiseParallel(use_local_output=i == 2)
    if sequence_parallel:
        net.append(nn.LayerNorm(dim, bias=False))
        plan["2.out_proj"] = RowwiseParallel(output_layouts=Shard(1))
        plan["3"] = SequenceParallel(sequence_dim=1)
    parallelize_module(net, mesh["tp"], plan)
    for mlp in net[:3]:
        if checkpointing:
            checkpoint(mlp)
        ENGINES[engine](mlp, mesh=mesh["dp"], reshard_after_forward=reshard)
    ENGINES[engine](net, mesh=mesh["dp"], reshard_after_forward=reshard)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(43 + mesh["dp"].get_local_rank())  # TP ranks see the same batch
    trace, patches = _tracing()
    out = {"losses": [], "layout": {name: (str(p.placements), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
                                    for name, p in net.named_parameters()}}
    for step in range(TP_STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)
        with patches[0], patches[1], patches[2]:
            loss = net(torch.randn(8, 4, dim) if sequence_parallel else torch.randn(8, dim)).sum()
            loss.backward()
        if step == 0:
            out["trace"] = list(trace)
        out["losses"].append(loss.full_tensor() if isinstance(loss, DTensor) else loss.detach())
        if step == TP_STEPS - 1:
            out["grads"] = [p.grad.to_local().clone() for p in net.parameters()]
        opt.step()
    out["full"] = {name: p.full_tensor() for name, p in net.named_parameters()}
    return out


def _tensor_parallel_refusal(engine):
    """An int reshard_after_forward over a TP parameter (dp 4 x tp 1: 2 divides the shard group)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    lin = parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel())

    def build_and_run():
        ENGINES[engine](lin, mesh=mesh["dp"], reshard_after_forward=2)
        lin(torch.randn(2, 4))
    return error_of(build_and_run)


def _worker(folder):
    rank = dist.get_rank()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) \
        if world % 2 == 0 else None
    training = {name: {engine: _train(engine, case, hsdp if case.mesh == "hsdp" else mesh, rank)
                       for engine in ENGINES}
                for name, case in CASES.items() if world in case.worlds}
    # checkpoints at 2 ranks (uneven shards already; time) and, HSDP's, at 4 (2 x 2); deferred
    # init at 1-3
    checkpoint = {} if world not in (2, 4) else {
        direction: _checkpoint(*engines, mesh if world == 2 else hsdp, rank, f"{folder}/{i}")
        for i, (direction, engines) in enumerate(
            (("torch->minidp", ("torch", "minidp")), ("minidp->torch", ("minidp", "torch"))))}
    out = {"training": training, "checkpoint": checkpoint, "errors": _bad_input(mesh),
           "meta": _deferred_init(mesh, rank) if world != 4 else None,
           "default mesh": _default_mesh(),
           "hang": _hang(rank) if dist.get_world_size() == 2 else None,
           "tensor parallel": None if world != 4 else {
               case: {engine: _tensor_parallel(engine, *case, rank) for engine in ENGINES} for case in TP_CASES},
           "tensor parallel refusal": None if world != 4 else
           {engine: _tensor_parallel_refusal(engine) for engine in ENGINES}}
    # ranks meet here: rank 0 hosts the store the others still build their meshes' groups through
    # (a rank outside a group finishes its part first); it must not exit before they are done
    dist.barrier()
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def ranks(request, tmp_path_factory):
    """Every rank's results at one world size: one launch runs every case."""
    return run_ranks(_worker, request.param, str(tmp_path_factory.mktemp("dcp")))


def _same(a, b):
    """The same nesting (dicts, lists, tuples) and leaves, tensors bit for bit and of one dtype."""
    (leaves, spec), (others, other_spec) = tree_flatten(a), tree_flatten(b)
    return spec == other_spec and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(leaves, others))


def _ran(ranks, case):
    if case not in ranks[0]["training"]:
        pytest.skip(f"{case} runs at {CASES[case].worlds} ranks only")


@pytest.mark.parametrize("case", CASES)
def test_training_equals_torch_fully_shard_bitwise(ranks, case):
    _ran(ranks, case)
    for rank, out in enumerate(ranks):
        mine, theirs = out["training"][case]["minidp"], out["training"][case]["torch"]
        for key in ("full", "grads", "losses", "norms", "output_dtype", "state_dict", "layout"):
            assert _same(mine.get(key), theirs.get(key)), (case, rank, key)
        ours = [entry for entry in mine["trace"] if entry[0] != "in flight before"]
        assert ours == theirs["trace"], (case, rank)  # the collectives of the first step
        if CASES[case].clip:  # the norms were above max_norm: clipping scaled the gradients
            assert all(norm > 0.05 for norm in mine["norms"]), mine["norms"]
        # every rank ends with the same full weights, and they moved
        # (an ignored parameter is trained on each rank's own gradient)
        assert _same({k: v for k, v in mine["full"].items() if k != IGNORED},
                     {k: v for k, v in ranks[0]["training"][case]["minidp"]["full"].items()
                      if k != IGNORED}), (case, rank)
    torch.manual_seed(0)
    first = dict((TiedNet() if CASES[case].tied else Net()).named_parameters())
    moved = {name for name, p in mine["full"].items() if not torch.equal(first[name], p)}
    assert moved == set(first) - {"unused.weight", "unused.bias"}, case  # unused: no gradient
    if CASES[case].tied:
        assert mine["grads"][-2:] == [None, None] and "mix2.weight" not in first
        kinds = {name: kind for name, (kind, *_) in mine["layout"].items()}
        assert kinds.pop(IGNORED) == "Parameter" and set(kinds.values()) == {"DTensor"}


def test_shards_are_laid_out_as_fsdp2s(ranks):
    """DTensor, Shard(0), torch.chunk's rows (padding is not in the local tensor), on every rank."""
    world = len(ranks)
    for rank, out in enumerate(ranks):
        mine = out["training"]["adamw"]["minidp"]["layout"]
        assert mine == out["training"]["adamw"]["torch"]["layout"], rank
        kind, placements, shape, local, _ = mine["head.weight"]
        assert (kind, shape) == ("DTensor", (3, 7)) and repr(placements) == "(Shard(dim=0),)"
        rows = torch.chunk(torch.empty(3), world)
        assert local == ((len(rows[rank]) if rank < len(rows) else 0), 7), (world, rank)
    names = list(ranks[0]["training"]["adamw"]["minidp"]["layout"])
    assert names == [f"{n}.{w}" for n in ["inp"] + [f"blocks.{i}.{s}" for i in range(2)
                                                      for s in ("up", "down")] + ["head"]
                     for w in ("weight", "bias")]


@pytest.mark.parametrize("case", ["adamw", "adamw-keep", "adamw-default-accumulate"])
def test_gathers_frees_and_collectives_as_fsdp2(ranks, case):
    """After forward the blocks hold shards (reshard_after_forward=True) or gathered ones (False);
    after backward everything is sharded again; one all-gather and one reduce-scatter per unit and
    pass, issued in torch's order (the backward prefetch included) with torch's sizes."""
    _ran(ranks, case)
    for rank, out in enumerate(ranks):
        mine, theirs = out["training"][case]["minidp"], out["training"][case]["torch"]
        assert mine["kinds"] == theirs["kinds"], (case, rank)
        ours = [entry for entry in mine["trace"] if entry[0] != "in flight before"]
        assert ours == theirs["trace"], (case, rank)
        # minidp's reduce-scatters run async, but one at a time: each holds a unit-sized buffer
        assert {n for what, n in mine["trace"] if what == "in flight before"} <= {0}, rank
    mine = ranks[0]["training"][case]["minidp"]
    reshard, accumulate = CASES[case].reshard, CASES[case].accumulate
    after_forward = mine["kinds"][0]
    root_params = after_forward[:2] + after_forward[-2:]
    assert set(after_forward[2:-2]) == {"shard" if reshard is not False else "full"}
    assert set(root_params) == {"shard" if reshard else "full"}
    assert set(mine["kinds"][-1]) == {"shard"}
    # minidp frees what it gathered: nothing held after backward, after forward what is kept
    (block, _, root), after_backward = mine["held"]
    world = len(ranks)

    def gathered(*shapes):  # fp32 bytes of world padded shards: ceil(rows / world) rows each
        return sum(4 * world * -(-rows // world) * cols for rows, cols in shapes)

    assert block == (0 if reshard is not False else gathered((15, 7), (15, 1), (7, 15), (7, 1)))
    assert root == (0 if reshard else gathered((7, 8), (7, 1), (3, 7), (3, 1)))
    assert after_backward == [0, 0, 0]
    if len(ranks) > 1:
        # 3 units: gathered before forward, again before backward where freed; reduced once
        regathered = 3 if reshard else (2 if reshard is None else 0)
        counts = Counter(name for name, _ in ours)
        assert counts == {"all_gather": accumulate * (3 + regathered), "reduce_scatter": 3}, case
        # minidp's timeline: a span for each collective, named by its unit's module
        lanes = Counter(lane.split()[-1] for lane, _, _ in mine["spans"])
        assert lanes == {"all-gather": counts["all_gather"], "reduce-scatter": 3}, mine["spans"]
        assert {name for _, name, _ in mine["spans"]} == {"", "blocks.0", "blocks.1"}
        assert all(ordered for _, _, ordered in mine["spans"])


def test_hsdp_reduces_within_then_across_replicas(ranks):
    """HSDP (2 replicas of W/2 ranks): each unit's gradients are reduce-scattered within the
    replica, then all-reduced across replicas, one of each per unit and step, in FSDP2's order
    (the trace equals torch's in the bitwise test); minidp's timeline shows both, per unit."""
    if len(ranks) not in (2, 4):
        pytest.skip("a 2-D mesh of 2 replicas at 2 and 4 ranks")
    mine = ranks[0]["training"]["adamw-hsdp"]["minidp"]
    counts = Counter(name for name, _ in mine["trace"] if name != "in flight before")
    assert counts["all_reduce"] == 3 and counts["reduce_scatter"] == (3 if len(ranks) == 4 else 0)
    lanes = Counter((lane.split()[-1], name) for lane, name, _ in mine["spans"])
    for unit in ("", "blocks.0", "blocks.1"):
        assert lanes[("all-reduce", unit)] == 1, lanes
        assert lanes[("reduce-scatter", unit)] == (1 if len(ranks) == 4 else 0), lanes
    accumulate = ranks[0]["training"]["sgd-hsdp-accumulate"]["minidp"]["trace"]
    counts = Counter(name for name, _ in accumulate if name != "in flight before")
    # two micro-batches: a reduce-scatter each, one all-reduce (set_requires_all_reduce)
    assert counts["all_reduce"] == 3 and counts["reduce_scatter"] == (6 if len(ranks) == 4 else 0)


def test_unshard_and_reshard_methods(ranks):
    for rank, out in enumerate(ranks):
        mine, theirs = out["training"]["adamw"]["minidp"], out["training"]["adamw"]["torch"]
        kinds, weight = mine["unshard"]
        assert _same(mine["unshard"], theirs["unshard"]), rank
        assert kinds[6:10] == ["full"] * 4 and kinds.count("full") == 4, rank  # blocks.1 only
        assert torch.equal(weight, mine["full"]["blocks.1.up.weight"]), rank
        assert mine["reshard"] == ["shard"] * 12, rank


def test_bad_input(ranks):
    errors = ranks[0]["errors"]
    mine, theirs = errors["container"]
    assert mine == theirs and mine[0] == "ValueError"
    mine, theirs = errors["non-contiguous"]
    assert mine == theirs and mine[0] == "NotImplementedError", (mine, theirs)
    (mine, message), (theirs, their_message) = errors["twice"]
    # the same words; the module's repr follows them (torch's module has changed class: FSDPNet)
    assert mine == theirs == "AssertionError", errors["twice"]
    assert message.split("\n")[0] == their_message.split("\n")[0]
    for case, kind in {"3-D mesh": "ValueError", "2-D mesh without names": "AssertionError",
                       "reshard int not a factor": "ValueError", "reshard str": "ValueError"}.items():
        mine, theirs = errors[case]
        assert mine == theirs and mine[0] == kind, (case, mine, theirs)  # type and message
    refused, allowed = errors["optimizer before"]
    assert refused[0] == "RuntimeError" and "AdamW" in refused[1], refused
    assert "build the optimizer after fully_shard(...)" in refused[1].lower(), refused
    assert allowed is None, allowed


def test_minidp_does_not_run_torchs_fsdp():
    """minidp's fully_shard imports no FSDP internals: only public policy types."""
    public = {"MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"}
    for path in Path(minidp.__file__).parent.joinpath("sharded", "fsdp").glob("*.py"):
        source = path.read_text()
        imports = re.findall(r"^(?:from|import) (torch\.distributed\.fsdp\S*)(.*)$", source, re.M)
        for module, names in imports:
            assert module == "torch.distributed.fsdp", path
            assert set(names.removeprefix(" import ").split(", ")) <= public, (path, names)


@pytest.mark.parametrize("direction", ["torch->minidp", "minidp->torch"])
def test_checkpoint_moves_between_torch_and_minidp(ranks, direction):
    """torch.distributed.checkpoint saved by one engine, loaded by the other: one step later both
    have the same full weights and AdamW state, bit for bit."""
    if not ranks[0]["checkpoint"]:
        pytest.skip("checkpoints run at 2 ranks (FSDP) and 4 (HSDP, 2 x 2)")
    for rank, out in enumerate(ranks):
        got = out["checkpoint"][direction]
        assert _same(got["minidp"], got["torch"]), (direction, rank)
        assert len(got["minidp"][1]["state"]) == 12, rank  # every parameter's AdamW state


def test_a_rank_that_does_not_arrive_is_named(ranks):
    if len(ranks) != 2:
        pytest.skip("runs at 2 ranks")
    kind, message = ranks[0]["hang"]
    assert kind == "RuntimeError", message
    assert "waited in vain in minidp.fully_shard's all-gather" in message, message
    assert "ranks that did not arrive: [1]" in message, message


def test_deferred_init_on_meta_as_fsdp2(ranks):
    if ranks[0]["meta"] is None:
        pytest.skip("runs at 1-3 ranks")
    for rank, out in enumerate(ranks):
        assert _same(out["meta"]["minidp"], out["meta"]["torch"]), rank
        assert _same(out["meta"]["minidp"], ranks[0]["meta"]["minidp"]), rank


def test_default_mesh_is_fsdp2s(ranks):
    for rank, out in enumerate(ranks):
        mine, theirs = out["default mesh"]["minidp"], out["default mesh"]["torch"]
        assert mine == theirs == ("cpu", (len(ranks),), (Shard(0),)), rank


@pytest.mark.parametrize("case", TP_CASES, ids=lambda c: f"dim{c[0]}-reshard{c[1]}-ckpt{c[2]}-sp{c[3]}")
def test_fsdp_over_tensor_parallel_equals_fsdp2s_bitwise(ranks, case):
    """FSDP over TP (torch's MLPStack, a 2 x 2 (dp, tp) mesh): the same joined-mesh placements
    (_StridedShard where TP and FSDP both cut dim 0), local pieces, losses, gradients, weights and
    FSDP collectives as torch's FSDP2, bit for bit, on every rank."""
    if len(ranks) != 4:
        pytest.skip("a 2 x 2 mesh: 4 ranks")
    for out in ranks:
        mine, theirs = out["tensor parallel"][case]["minidp"], out["tensor parallel"][case]["torch"]
        for key in ("layout", "losses", "grads", "full", "trace"):
            assert _same(mine[key], theirs[key]), (case, key)
    layout = ranks[0]["tensor parallel"][case]["minidp"]["layout"]
    assert layout["0.in_proj.weight"][0] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", layout
    assert layout["0.out_proj.weight"][0] == "(Shard(dim=0), Shard(dim=1))", layout
    assert layout["0.out_proj.bias"][0] == "(Shard(dim=0), Replicate())", layout
    if case[3]:  # the LayerNorm's weight: sharded by FSDP, replicated by TP (its gradient was Partial)
        assert layout["3.weight"][0] == "(Shard(dim=0), Replicate())", layout
    if case[0] == 5:  # 15 rows: 8 and 7 a TP rank, then 4 + 4 and 4 + 3 a DP rank
        assert sorted({out["tensor parallel"][case]["minidp"]["layout"]["0.in_proj.weight"][1]
                       for out in ranks}) == [(3, 5), (4, 5)]


def test_fsdp_over_tensor_parallel_refuses_an_int_reshard_as_fsdp2(ranks):
    if len(ranks) != 4:
        pytest.skip("a 4 x 1 mesh: 4 ranks")
    refusal = ranks[0]["tensor parallel refusal"]
    assert refusal["minidp"] == refusal["torch"] == (
        "NotImplementedError", "Resharding to smaller mesh is not supported for DTensor parameters yet")
