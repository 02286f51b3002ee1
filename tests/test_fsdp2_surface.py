"""minidp.fully_shard's FSDP2 surface against torch's FSDP2: FSDPModule, its methods, the partial
forward of a list unit, and the refusals.

One launch at 2 ranks (it runs in worker processes: a crash, such as the segmentation fault the
partial forward once caused, fails these tests, not the suite). For each scenario every rank builds
the same small model with each engine, runs the same steps, and returns plain results: the full
weights after 20 steps, the last gradients and the first step's collectives; or, for a refusal, the
exception's type and message. The tests below compare the engines.
"""
from __future__ import annotations

import copy
import re
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # the contract
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_flatten

import minidp
from harness import error_of, run_ranks

STEPS = 20
ENGINES = {"minidp": (minidp.fully_shard, minidp.register_fsdp_forward_method,
                      minidp.share_comm_ctx),
           "torch": (torch_fully_shard, torch_register, torch_share_comm_ctx)}


class Block(nn.Module):
    def __init__(self, width=8, hidden=6):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class ChunkedNet(nn.Module):
    """Chunked-loss training (FSDP2's motivating case for a list unit): forward runs the blocks
    and the norm only; the loss calls the head chunk by chunk."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8)  # never called: no gradient, unless reduced as zeros

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def score(self, tokens):  # another entry point (register_fsdp_forward_method)
        return self.head(self.forward(tokens))


def _build(engine, mesh, **kwargs):
    """ChunkedNet sharded by `engine`: a unit per block, the embedding, [norm, head], the root."""
    shard = ENGINES[engine][0]
    torch.manual_seed(0)
    net = ChunkedNet()
    for block in net.blocks:
        shard(block, mesh=mesh, **kwargs)
    shard(net.embed, mesh=mesh, **kwargs)
    shard([net.norm, net.head], mesh=mesh, **kwargs)
    return shard(net, mesh=mesh, **kwargs)


def _chunked_loss(net, tokens, y):
    """The head on each half of the batch after a forward that skipped it (the partial forward)."""
    h = net(tokens)
    return sum(F.mse_loss(net.head(chunk), target) for chunk, target in
               zip(h.chunk(2), y.chunk(2)))


def _batches(rank, steps=STEPS):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 10, (4,), generator=gen), torch.randn(4, 3, generator=gen))
            for _ in range(steps)]


def _tracing():
    """Record each collective both engines issue through torch.distributed: (name, numel, op)."""
    trace = []

    def traced(name, real):
        def call(*args, **kwargs):
            output = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            trace.append((name, output.numel(), str(kwargs.get("op"))))
            return real(*args, **kwargs)
        return mock.patch.object(dist, name, call)

    return trace, [traced(name, getattr(dist, name)) for name in
                   ("all_gather_single", "reduce_scatter_single", "all_reduce")]


def _train(engine, mesh, rank, setup=None, loss=_chunked_loss, micro=1, **kwargs):
    """Build, call setup(net) (the methods under test), train STEPS steps of `micro` micro-batches
    with SGD; return the full weights, the last gradients and the first step's collectives."""
    net = _build(engine, mesh, **kwargs)
    if setup is not None:
        setup(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    trace, patches = _tracing()
    batches = _batches(rank, STEPS * micro)
    for step in range(STEPS):
        for k in range(micro):
            tokens, y = batches[step * micro + k]
            net.set_is_last_backward(k == micro - 1)
            if step == 0:
                with patches[0], patches[1], patches[2]:
                    loss(net, tokens, y).backward()
            else:
                loss(net, tokens, y).backward()
        grads = {n: None if p.grad is None else p.grad.to_local().clone()
                 for n, p in net.named_parameters()}
        opt.step()
        opt.zero_grad()
    for module in net.modules():  # reshard_after_backward=False keeps some gathered
        if isinstance(module, (minidp.FSDPModule, TorchFSDPModule)):
            module.reshard()
    full = {n: p.full_tensor() for n, p in net.named_parameters()}
    return {"full": full, "grads": grads, "trace": trace}


class CountingAllGather(AllGather):
    """A custom all-gather (FSDP2's AllGather contract) that counts its calls."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _custom_comms(net):
    net.blocks[0].set_custom_all_gather(gather := CountingAllGather())
    net.blocks[0].set_custom_reduce_scatter(reduce := CountingReduceScatter())
    net.comms = (gather, reduce)


def _double_in_hook(net):
    net.blocks[1].set_all_reduce_hook(lambda reduced: reduced.mul_(2))


def _fail_then_reset(net):
    """A forward that raises halfway (after the blocks gathered), then reset_iter_state."""
    with mock.patch.object(type(net.norm), "forward", side_effect=RuntimeError("in norm")):
        try:
            net(torch.tensor([1, 2, 3, 4]))
        except RuntimeError:
            pass
    net.reset_iter_state()


def _halve_in_a_hook(net):
    """A post-accumulate-grad hook on every sharded parameter (where an optimizer-in-backward
    steps): it halves the reduced gradient."""
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: p.grad.to_local().mul_(0.5))


def _backward_per_chunk(net, tokens, y):
    """torch's own chunked-loss test's loop: the head on each detached chunk with a backward of
    its own (only the head's unit in that graph), then one backward through the rest. Returns a
    loss whose backward is that last one."""
    h = net(tokens)
    grads = []
    for chunk, target in zip(h.detach().chunk(2), y.chunk(2)):
        chunk = chunk.contiguous().requires_grad_(True)
        F.mse_loss(net.head(chunk), target).backward()
        assert net.head.weight.grad is not None, "the head's reduce-scatter was left in flight"
        grads.append(chunk.grad)
    return (h * torch.cat(grads)).sum()


def _scored(net, tokens, y):
    return F.mse_loss(net.score(tokens), y)


SCENARIOS = {  # name: keyword arguments of _train
    "partial forward (chunked loss)": {},
    "partial forward, a backward per chunk": {"loss": _backward_per_chunk},
    "unused params reduced as zeros": {
        "setup": lambda net: net.set_reduce_scatter_unused_params(True)},
    "no gather in the embedding's backward": {
        "setup": lambda net: net.embed.set_unshard_in_backward(False)},
    "force sum reduction": {"setup": lambda net: [  # not recursive in FSDP2: on each module
        m.set_force_sum_reduction_for_comms(True) for m in net.modules()
        if hasattr(m, "set_force_sum_reduction_for_comms")]},
    "all-reduce hook": {"setup": _double_in_hook},
    "post-accumulate-grad hooks": {"setup": _halve_in_a_hook},
    "custom comms": {"setup": _custom_comms},
    "two reduce-scatters in flight": {
        "setup": lambda net: net.set_reduce_scatter_max_input_buffers(2)},
    "separate reduce-scatter group": {
        "setup": lambda net: net.set_separate_reduce_scatter_group()},
    "micro-batches, set_is_last_backward": {"micro": 2},
    "reset_iter_state after a failed forward": {"setup": _fail_then_reset},
    "register_fsdp_forward_method": {
        "setup": lambda net: None, "loss": _scored, "register": True},
    "reshard_after_forward=False, keep after backward": {
        "reshard_after_forward": False,
        "setup": lambda net: net.set_reshard_after_backward(False)},
}


def _scenario(engine, mesh, rank, name):
    kwargs = dict(SCENARIOS[name])
    if kwargs.pop("register", False):
        setup = kwargs["setup"]
        kwargs["setup"] = lambda net: (setup(net), ENGINES[engine][1](net, "score"))
    out = _train(engine, mesh, rank, **kwargs)
    return out


def _two_roots(engine, mesh, rank):
    """Two roots (pipeline stages, each its own fully_shard root) sharing one communication context
    (share_comm_ctx), trained 5 steps as one model: their full weights."""
    shard, _, share = ENGINES[engine]
    torch.manual_seed(0)
    stages = [Block(), Block()]
    for stage in stages:
        shard(stage.up, mesh=mesh)
        shard(stage, mesh=mesh)
    share(stages)
    opt = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        stages[1](stages[0](torch.randn(4, 8, generator=gen))).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for s in stages for p in s.parameters()]


def _surface(mesh):
    """What FSDPModule is and has, per engine."""
    out = {}
    for engine in ENGINES:
        net = _build(engine, mesh)
        kind = minidp.FSDPModule if engine == "minidp" else TorchFSDPModule
        handle = net.blocks[0].unshard(async_op=True)
        handle.wait()
        out[engine] = {
            "classes": [type(m).__name__ for m in (net, net.blocks[0], net.norm, net.head)],
            "isinstance": [isinstance(m, kind) for m in (net, net.blocks[0], net.head,
                                                           net.blocks[0].up)],
            "unsharded after wait": [type(p).__name__ for p in net.blocks[0].parameters()],
            "handle": [c.__name__ for c in type(handle).__mro__].count("UnshardHandle"),
            "returns": type(ENGINES[engine][0](nn.Linear(2, 2), mesh=mesh)).__name__,
        }
        net.blocks[0].reshard()
        out[engine]["two roots, one context"] = _two_roots(engine, mesh, dist.get_rank())
    out["methods"] = (sorted(n for n in dir(minidp.FSDPModule) if not n.startswith("_")),
                      sorted(n for n in dir(TorchFSDPModule) if not n.startswith("_")))
    return out


def _refusals(mesh):
    """(minidp's error, torch's error) for what FSDP2 refuses, as (type, message)."""
    out = {}

    def both(case, make):
        out[case] = tuple(make(engine) for engine in ENGINES)

    both("deepcopy", lambda engine: error_of(copy.deepcopy, _build(engine, mesh)))

    def tied(engine):  # one weight in two units: refused at the first forward
        shard = ENGINES[engine][0]
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        b.weight = a.weight
        root = nn.Sequential(a, b)
        shard(a, mesh=mesh)
        shard(b, mesh=mesh)
        shard(root, mesh=mesh)
        return error_of(root, torch.randn(2, 4))

    both("tied across units", tied)
    both("uneven Shard(1)", lambda engine: error_of(
        ENGINES[engine][0], nn.Linear(3, 2), mesh=mesh, shard_placement_fn=lambda p: Shard(1)))

    def not_root(engine):
        net = _build(engine, mesh)
        net(torch.tensor([1, 2, 3, 4]))
        return error_of(net.blocks[0].reset_iter_state)

    both("reset_iter_state off the root", not_root)
    both("prefetch a plain module", lambda engine: error_of(
        _build(engine, mesh).set_modules_to_forward_prefetch, [nn.Linear(2, 2)]))
    both("max input buffers True", lambda engine: error_of(
        _build(engine, mesh).set_reduce_scatter_max_input_buffers, True))
    both("max input buffers 0", lambda engine: error_of(
        _build(engine, mesh).set_reduce_scatter_max_input_buffers, 0))
    both("no such method", lambda engine: error_of(
        ENGINES[engine][1], _build(engine, mesh), "generate"))
    def symmetric_memory(engine):  # accepted; the first gather on the CPU has no pool for it
        net = _build(engine, mesh)
        net.blocks[0].set_symm_mem_for_comm()
        return error_of(net, torch.tensor([1, 2, 3, 4]))

    both("NCCL symmetric memory on the CPU", symmetric_memory)
    both("share_comm_ctx with a plain module", lambda engine: error_of(
        ENGINES[engine][2], [nn.Linear(2, 2)]))
    both("reshard int not a bool later", lambda engine: error_of(
        _build(engine, mesh).set_reshard_after_forward, 2))
    return out


def _worker():
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    scenarios = {name: {engine: _scenario(engine, mesh, rank, name) for engine in ENGINES}
                 for name in SCENARIOS}
    out = {"scenarios": scenarios, "surface": _surface(mesh), "refusals": _refusals(mesh)}
    dist.barrier()  # ranks meet here: rank 0 hosts the store; it exits after the others' groups
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_worker, 2)


def _same(a, b):
    (leaves, spec), (others, other_spec) = tree_flatten(a), tree_flatten(b)
    return spec == other_spec and all(
        torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(leaves, others))


@pytest.mark.parametrize("name", SCENARIOS)
def test_methods_train_bitwise_as_fsdp2(ranks, name):
    """Each method, set as FSDP2's documentation says, trains to FSDP2's weights bit for bit,
    with FSDP2's collectives in its order (20 steps, 2 ranks)."""
    for rank, out in enumerate(ranks):
        mine, theirs = out["scenarios"][name]["minidp"], out["scenarios"][name]["torch"]
        assert _same(mine["full"], theirs["full"]), (name, rank)
        assert _same(mine["grads"], theirs["grads"]), (name, rank)
        assert mine["trace"] == theirs["trace"], (name, rank, mine["trace"], theirs["trace"])
    default = ranks[0]["scenarios"]["partial forward (chunked loss)"]["minidp"]
    mine = ranks[0]["scenarios"][name]["minidp"]
    if name == "unused params reduced as zeros":  # the unused layer now has zero gradients
        assert default["grads"]["unused.weight"] is None
        assert torch.equal(mine["grads"]["unused.weight"],
                           torch.zeros_like(mine["grads"]["unused.weight"]))
    if name == "no gather in the embedding's backward":  # one all-gather fewer
        assert len(mine["trace"]) == len(default["trace"]) - 1
    if name in ("all-reduce hook", "post-accumulate-grad hooks"):  # it changed the result
        assert not _same(mine["full"], default["full"])
    if name == "force sum reduction":  # SUM, then a division (bitwise AVG's on gloo)
        assert {op for *_, op in mine["trace"] if op != "None"} == {"RedOpType.SUM"}, mine["trace"]
        assert {op for *_, op in default["trace"] if op != "None"} == {"RedOpType.AVG"}


def test_partial_forward_reduces_the_list_unit_per_call(ranks):
    """The head, skipped by forward and then called on two chunks, runs on gathered weights (not
    a crash, not the shards), and its unit reduces as FSDP2 2.14's does: the head's gradients as
    soon as the first chunk call's backward is done (18 elements a rank: 2 padded rows of 8 and 2
    of the bias), the norm's after (8), then the blocks (55 each) and the embedding (40); the
    root's only layer is unused (no gradient, no reduce-scatter)."""
    trace = ranks[0]["scenarios"]["partial forward (chunked loss)"]["minidp"]["trace"]
    reduced = [numel for name, numel, _ in trace if name == "reduce_scatter_single"]
    assert reduced == [18, 8, 55, 55, 40], reduced
    assert ranks[0]["scenarios"]["partial forward (chunked loss)"]["minidp"]["grads"][
        "head.weight"] is not None


def test_fsdp_module_class_swap_and_methods(ranks):
    surface = ranks[0]["surface"]
    mine, theirs = surface["minidp"], surface["torch"]
    assert _same(mine, theirs), (mine, theirs)
    assert mine["classes"] == ["FSDPChunkedNet", "FSDPBlock", "FSDPLayerNorm", "FSDPLinear"]
    assert mine["isinstance"] == [True, True, True, False]
    assert mine["unsharded after wait"] == ["Parameter"] * 4
    methods, torch_methods = surface["methods"]
    assert set(torch_methods) <= set(methods), set(torch_methods) - set(methods)
    assert len(torch_methods) == 23


def _unqualified(error):
    """An error with classes named as FSDP<Name> only (each engine makes the class in its own
    module: minidp.sharded.fsdp.module, torch's _fsdp_init)."""
    kind, message = error
    return kind, re.sub(r"<class '[\w.]+\.(FSDP\w+)'>", r"<class '\1'>", message)


def test_refusals_are_fsdp2s(ranks):
    """The same exception type and message as FSDP2's for each misuse."""
    refusals = dict(ranks[0]["refusals"])
    for case, (mine, theirs) in refusals.items():
        assert mine is not None and _unqualified(mine) == _unqualified(theirs), (case, mine, theirs)
