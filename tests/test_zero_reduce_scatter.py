"""ZeroRedundancyOptimizer(reduce_scatter=True) + hook_with_zero_reduce_scatter: ZeRO-1 at DDP's bytes.

One launch per world size (1-4): the worker runs every case on its ranks and returns plain values;
the tests compare. Each training case trains the same model from the same weights and batches for
20 steps twice, with the plain ZeRO step (minidp.DDP's all-reduce, step, broadcasts) and with the
reduce-scatter variant, the lr halved midway (a scheduler's change must reach the local optimizer).
At 1 and 2 ranks the two end bitwise equal (a sum of two numbers has one order); at 3 and 4 ranks
gloo's reduce-scatter and its ring all-reduce add an element's terms in different orders, so the
weights differ in the last bits: measured and bounded here.
Checkpoints: the variant's consolidated state dict is compared with the plain step's (the same
format: a plain optimizer's), and a fresh variant resumed from it must go on exactly as the run
that was not stopped.
Bytes: torch's profiler records every c10d collective with its tensors' shapes; a collective of S
elements costs a rank (N-1)/N S (reduce-scatter, all-gather, broadcast) or 2(N-1)/N S (all-reduce).
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import minidp
from harness import error_of, run_ranks
from minidp.sharded.zero import hook_with_zero_reduce_scatter
from minidp.sharded.zero.reduce_scatter import cut_pieces, plan_shard_buckets
from training import rank_batches, snapshot, train

STEPS = 20
ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
SMALL_CAP_MB = 1100 * 4 / 2**20  # shard buckets of <= 1,100 fp32 elements: 4 buckets for Net
# name -> (optimizer class, defaults, two parameter groups, tied weights, overlap, cap)
CASES = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, False, False, False, 25.0),
    "sgd-tied-small": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True},
                       False, True, True, SMALL_CAP_MB),
    "adamw-groups-small-overlap": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05},
                                   True, False, True, SMALL_CAP_MB),
}


class Net(nn.Module):
    """Parameters of many sizes: 8x32, 32x32 (twice, or tied), 32x4 and biases (2,468 elements)."""

    def __init__(self, tied=False):
        super().__init__()
        self.a, self.b, self.b2, self.head = (nn.Linear(8, 32), nn.Linear(32, 32),
                                              nn.Linear(32, 32), nn.Linear(32, 4))
        if tied:
            self.b2.weight = self.b.weight

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(torch.tanh(self.b2(h)))


def _params(net, groups):
    if not groups:
        return list(net.parameters())
    return [{"params": [p for p in net.parameters() if p.dim() == 2], "weight_decay": 0.01},
            {"params": [p for p in net.parameters() if p.dim() == 1], "lr": 0.02}]


def _build(case, variant, ddp_cls=minidp.DDP, zero_cls=minidp.ZeroRedundancyOptimizer):
    optimizer_class, defaults, groups, tied, overlap, cap = CASES[case]
    torch.manual_seed(0)
    net = Net(tied)
    model = ddp_cls(net)
    if not variant:
        return net, model, zero_cls(_params(net, groups), optimizer_class, **defaults)
    opt = zero_cls(_params(net, groups), optimizer_class, reduce_scatter=True, **defaults)
    model.register_comm_hook(None, hook_with_zero_reduce_scatter(
        model, opt, bucket_cap_mb=cap, overlap_param_gather=overlap))
    return net, model, opt


def _halve_lr_midway(opt):
    def per_step(step):
        if step == STEPS // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5
    return per_step


def _training(rank):
    out = {}
    for case in CASES:
        weights = {}
        for variant in (False, True):
            net, model, opt = _build(case, variant)
            train(model, opt, rank_batches(STEPS, rank), per_step=_halve_lr_midway(opt))
            model(torch.zeros(1, 8))  # a forward: an overlapped all-gather lands before reading
            weights[variant] = snapshot(net)
        out[case] = {"plain": weights[False], "variant": weights[True],
                     "state_numel": sum(t.numel() for s in opt.optim.state.values()
                                        for t in s.values() if t.dim() > 0)}
    return out


def _checkpoints(rank, world_size):
    """Per case: the consolidated state dicts of the plain step and the variant after STEPS // 2
    steps (on the last rank), and the variant's final weights, uninterrupted and resumed from its
    checkpoint in a fresh optimizer (the dict travels to every rank, as a file read by all)."""
    out = {}
    to = world_size - 1
    half = rank_batches(STEPS, rank)
    for case in ("sgd-tied-small", "adamw-groups-small-overlap"):
        saved = {}
        for variant in (False, True):
            net, model, opt = _build(case, variant)
            train(model, opt, half[:STEPS // 2])
            model(torch.zeros(1, 8))
            opt.consolidate_state_dict(to=to)
            saved[variant] = [opt.state_dict() if rank == to else None]
            dist.broadcast_object_list(saved[variant], src=to)
        weights = snapshot(net)
        train(model, opt, half[STEPS // 2:])
        model(torch.zeros(1, 8))
        fresh_net, fresh_model, fresh = _build(case, True)
        with torch.no_grad():
            for p, q in zip(fresh_net.parameters(), weights):
                p.copy_(q)
        fresh.load_state_dict(saved[True][0])
        train(fresh_model, fresh, half[STEPS // 2:])
        fresh_model(torch.zeros(1, 8))
        out[case] = {"plain": saved[False][0], "variant": saved[True][0],
                     "uninterrupted": snapshot(net), "resumed": snapshot(fresh_net)}
    # parameter groups added before the hook: the hook's layout takes them
    torch.manual_seed(0)
    net = Net()
    model = minidp.DDP(net)
    groups = _params(net, True)
    opt = minidp.ZeroRedundancyOptimizer(groups[0]["params"], torch.optim.AdamW, reduce_scatter=True,
                                         lr=0.01, weight_decay=0.01)
    opt.add_param_group(groups[1])
    model.register_comm_hook(None, hook_with_zero_reduce_scatter(model, opt))
    train(model, opt, half)
    out["added_group"] = snapshot(net)
    torch.manual_seed(0)
    net = Net()
    model = minidp.DDP(net)
    opt = minidp.ZeroRedundancyOptimizer(_params(net, True), torch.optim.AdamW, reduce_scatter=True,
                                         lr=0.01, weight_decay=0.01)
    model.register_comm_hook(None, hook_with_zero_reduce_scatter(model, opt))
    train(model, opt, half)
    out["groups_at_construction"] = snapshot(net)
    return out


def _bytes_of_one_step(model, opt, batch, world_size) -> dict:
    """{collective: elements a rank sends} of one step (after 3), and the parameters' count."""
    for _ in range(3):
        _step(model, opt, batch)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 experimental_config=ALL_THREADS) as prof:
        _step(model, opt, batch)
        model(batch[0])  # overlapped all-gathers end in the next forward
        dist.barrier()
    return sent_per_collective(prof.events(), world_size)


def sent_per_collective(events, world_size) -> dict:
    """{c10d collective: elements a rank sends}: (N-1)/N of a collective's whole tensor, twice that
    for an all-reduce. A tensor-list collective (allreduce_, broadcast_) records no shapes: its size is
    its gloo event's (gloo:all_reduce, gloo:broadcast), less the gloo:all_reduce that gloo's
    _reduce_scatter_base_ runs underneath (torch 2.14's gloo reduce-scatters by all-reducing)."""
    ring = (world_size - 1) / world_size
    whole, counts, gloo = {}, {}, {"gloo:all_reduce": 0, "gloo:broadcast": 0}
    for event in events:
        elements = max([_numel(shapes) for shapes in event.input_shapes] + [0])
        if event.name in gloo:
            gloo[event.name] += elements
        elif event.name.startswith("c10d::") and event.name != "c10d::barrier":
            whole[event.name] = whole.get(event.name, 0) + elements
            counts[event.name] = counts.get(event.name, 0) + 1
    if "c10d::allreduce_" in whole:
        whole["c10d::allreduce_"] = gloo["gloo:all_reduce"] - whole.get("c10d::_reduce_scatter_base_", 0)
    if "c10d::broadcast_" in whole:
        whole["c10d::broadcast_"] = gloo["gloo:broadcast"]
    return {name: (2 * ring if name == "c10d::allreduce_" else ring) * n for name, n in whole.items()}


def _numel(shapes) -> int:
    if not shapes:
        return 0
    if isinstance(shapes[0], list):
        return sum(_numel(s) for s in shapes)
    n = 1
    for d in shapes:
        n *= d
    return n


def _step(model, opt, batch):
    F.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()
    opt.zero_grad()


def _bytes(rank, world_size):
    batch = rank_batches(1, rank)[0]
    out = {}
    for name, variant, ddp_cls, zero_cls in (("variant", True, minidp.DDP, None),
                                             ("minidp_plain", False, minidp.DDP, None),
                                             ("torch_zero", False, TorchDDP, TorchZero)):
        kwargs = {"ddp_cls": ddp_cls} | ({"zero_cls": zero_cls} if zero_cls else {})
        net, model, opt = _build("adamw-groups-small-overlap", variant, **kwargs)
        out[name] = _bytes_of_one_step(model, opt, batch, world_size)
    out["params"] = sum(p.numel() for p in Net().parameters())
    return out


def _timeline(rank):
    """overlap_param_gather: record a step and the next forward; the lanes' events in order."""
    net, model, opt = _build("adamw-groups-small-overlap", True)
    batch = rank_batches(1, rank)[0]
    _step(model, opt, batch)
    timeline = model.enable_timeline()
    _step(model, opt, batch)
    timeline.record("forward_start")
    model(batch[0])
    timeline.record("forward_end")
    return [(kind, f.get("lane"), f.get("name")) for kind, _, f in
            sorted(timeline.events, key=lambda e: e[1])
            if kind in ("forward_start", "forward_end") or str(f.get("lane", "")).startswith("ZeRO")]


def _bad_arguments():
    net = Net()
    model = minidp.DDP(net)
    sgd = torch.optim.SGD
    plain = minidp.ZeroRedundancyOptimizer(net.parameters(), sgd, lr=0.1)
    fresh = minidp.ZeroRedundancyOptimizer(net.parameters(), sgd, reduce_scatter=True, lr=0.1)
    unhooked = error_of(fresh.step)
    made = minidp.ZeroRedundancyOptimizer(net.parameters(), sgd, reduce_scatter=True, lr=0.1)
    hook = hook_with_zero_reduce_scatter(model, made)
    model.register_comm_hook(None, hook)
    errors = {
        "not_bool": error_of(lambda: minidp.ZeroRedundancyOptimizer(
            net.parameters(), sgd, reduce_scatter="yes", lr=0.1)),
        "with_overlap": error_of(lambda: minidp.ZeroRedundancyOptimizer(
            net.parameters(), sgd, reduce_scatter=True, overlap_with_ddp=True, lr=0.1)),
        "with_bucket_view": error_of(lambda: minidp.ZeroRedundancyOptimizer(
            net.parameters(), sgd, reduce_scatter=True, parameters_as_bucket_view=True, lr=0.1)),
        "plain_zero": error_of(lambda: hook_with_zero_reduce_scatter(model, plain)),
        "cap": error_of(lambda: hook_with_zero_reduce_scatter(model, minidp.ZeroRedundancyOptimizer(
            net.parameters(), sgd, reduce_scatter=True, lr=0.1), bucket_cap_mb=0)),
        "overlap_not_bool": error_of(lambda: hook_with_zero_reduce_scatter(
            model, minidp.ZeroRedundancyOptimizer(net.parameters(), sgd, reduce_scatter=True,
                                                  lr=0.1), overlap_param_gather="no")),
        "not_ddp": error_of(lambda: hook_with_zero_reduce_scatter(object(), made)),
        "twice": error_of(lambda: hook_with_zero_reduce_scatter(model, made)),
        "foreign": error_of(lambda: hook_with_zero_reduce_scatter(
            model, minidp.ZeroRedundancyOptimizer([nn.Parameter(torch.ones(3))], sgd,
                                                  reduce_scatter=True, lr=0.1))),
        "unhooked_step": unhooked,
        "step_before_backward": error_of(made.step),
        "add_param_group": error_of(lambda: made.add_param_group(
            {"params": [nn.Parameter(torch.ones(2))]})),
        "unhooked_state_dict": error_of(fresh.consolidate_state_dict),
        "not_consolidated": error_of(made.state_dict),
        "whole_tensor_optimizer": error_of(lambda: minidp.ZeroRedundancyOptimizer(
            net.parameters(), torch.optim.LBFGS, reduce_scatter=True)),
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        minidp.ZeroRedundancyOptimizer(net.parameters(), Lars, reduce_scatter=True, lr=0.1)
    errors["unknown_optimizer_warns"] = [str(w.message) for w in caught]
    return errors


class Lars(torch.optim.SGD):
    """A stand-in for a user's optimizer class that is not one of torch's element-wise ones."""


def _worker():
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return {"training": _training(rank), "bytes": _bytes(rank, world_size),
            "timeline": _timeline(rank), "errors": _bad_arguments(),
            "checkpoints": _checkpoints(rank, world_size)}


import pytest  # noqa: E402


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def ranks(request):
    """Every rank's results at one world size: one launch runs every case."""
    return request.param, run_ranks(_worker, request.param)


def _max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES)
def test_weights_equal_the_plain_zero_step(ranks, case):
    world_size, outs = ranks
    first = outs[0]["training"][case]["variant"]
    for rank, out in enumerate(outs):
        got = out["training"][case]
        assert _equal(got["variant"], first), rank  # the all-gather: every rank every weight
        if world_size <= 2:  # a + b: one order
            assert _equal(got["variant"], got["plain"]), rank
        else:  # measured: <= 6e-8 (1-2 float32 ulps of weights ~0.1-1) after 20 steps
            assert 0 <= _max_diff(got["variant"], got["plain"]) < 1e-6, rank
    # the optimizer state is sharded: the ranks' tensor states add up to one copy (Adam: 2 per
    # parameter element, SGD's momentum: 1); tied weights are stepped once
    numel = sum(p.numel() for p in Net(tied="tied" in case).parameters())
    per_element = 2 if "adamw" in case else 1
    assert sum(out["training"][case]["state_numel"] for out in outs) == per_element * numel


def test_bytes_are_ddps_and_two_thirds_of_torch_zeros(ranks):
    world_size, outs = ranks
    for out in outs:
        got, params = out["bytes"], out["bytes"]["params"]
        ring = (world_size - 1) / world_size
        variant = sum(got["variant"].values())
        assert set(got["variant"]) == {"c10d::_reduce_scatter_base_", "c10d::_allgather_base_"}
        assert set(got["torch_zero"]) == {"c10d::allreduce_", "c10d::broadcast_"}
        torch_zero = sum(got["torch_zero"].values())
        # padding: each of the 4 shard buckets rounds up to N chunks, < N elements each
        assert 2 * ring * params <= variant <= 2 * ring * (params + 4 * world_size)
        assert torch_zero == pytest.approx(3 * ring * params)
        assert sum(got["minidp_plain"].values()) == pytest.approx(torch_zero)


def test_overlap_the_next_forward_waits_module_by_module(ranks):
    world_size, outs = ranks
    events = outs[0]["timeline"]
    names = [(kind, name) for kind, _, name in events]
    gathers = [n for k, n in names if k == "begin" and n.startswith("all-gather")]
    assert gathers == [f"all-gather bucket {k}" for k in range(4)]
    scatters = [n for k, n in names if k == "begin" and n.startswith("reduce-scatter")]
    assert scatters == [f"reduce-scatter bucket {k}" for k in (3, 2, 1, 0)]
    start = names.index(("forward_start", None))
    # every all-gather started before the forward, each module waits for its own bucket in it
    assert all(names.index(("begin", g)) < start for g in gathers)
    waits = [n for k, n in names[start:] if k == "begin" and "waits" in n]
    assert waits == ["a waits for bucket 0", "b waits for bucket 1", "b2 waits for bucket 2",
                     "head waits for bucket 3"], waits


def test_bad_input_is_refused_naming_the_argument(ranks):
    _, outs = ranks
    errors = outs[0]["errors"]
    expected = {"not_bool": (TypeError, "reduce_scatter"),
                "with_overlap": (ValueError, "overlap_with_ddp"),
                "with_bucket_view": (ValueError, "parameters_as_bucket_view"),
                "plain_zero": (ValueError, "reduce_scatter=True"),
                "cap": (ValueError, "bucket_cap_mb"),
                "overlap_not_bool": (TypeError, "overlap_param_gather"),
                "not_ddp": (TypeError, "ddp must be a DDP model"),
                "twice": (RuntimeError, "hook already"),
                "foreign": (ValueError, "not ddp's module's"),
                "unhooked_step": (RuntimeError, "register_comm_hook"),
                "step_before_backward": (RuntimeError, "no gradient was reduce-scattered"),
                "add_param_group": (RuntimeError, "before making the hook"),
                "unhooked_state_dict": (RuntimeError, "register_comm_hook"),
                "not_consolidated": (RuntimeError, "consolidate_state_dict"),
                "whole_tensor_optimizer": (ValueError, "optimizer_class=LBFGS")}
    for name, (kind, words) in expected.items():
        got = errors[name]
        assert got is not None and got[0] == kind.__name__ and words in got[1], (name, got)
    assert len(errors["unknown_optimizer_warns"]) == 1
    assert "optimizer_class=Lars" in errors["unknown_optimizer_warns"][0]


def _state_dicts_match(a: dict, b: dict, exact: bool) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for index, entry in a["state"].items():
        assert list(entry) == list(b["state"][index]), index
        for key, value in entry.items():
            other = b["state"][index][key]
            assert value.shape == other.shape and value.dtype == other.dtype, (index, key)
            if exact:
                assert torch.equal(value, other), (index, key)
            else:  # gloo's sums in another order (see the weights' test)
                assert (value - other).abs().max().item() < 1e-6, (index, key)


def test_checkpoint_is_the_plain_steps_and_resumes_exactly(ranks):
    world_size, outs = ranks
    for case in ("sgd-tied-small", "adamw-groups-small-overlap"):
        got = outs[0]["checkpoints"][case]
        assert got["variant"]["state"], case  # something to compare: every parameter's state
        _state_dicts_match(got["variant"], got["plain"], exact=world_size <= 2)
        for rank, out in enumerate(outs):  # resumed in a fresh optimizer: as if never stopped
            assert _equal(out["checkpoints"][case]["resumed"],
                          out["checkpoints"][case]["uninterrupted"]), (case, rank)


def test_a_group_added_before_the_hook_is_sharded_with_the_others(ranks):
    _, outs = ranks
    for out in outs:
        assert _equal(out["checkpoints"]["added_group"], out["checkpoints"]["groups_at_construction"])


def test_shard_buckets_and_pieces_by_hand():
    assert plan_shard_buckets([256, 32, 1024, 32, 1024, 32, 128, 4], 2000) == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan_shard_buckets([5000, 1], 2000) == [[0], [1]]  # a large one alone
    # a bucket of 10 elements at 3 ranks: chunks of 4 (2 of padding); a parameter at 3..9
    assert cut_pieces(3, 6, 4, 3) == [(0, 0, 1), (1, 1, 5), (2, 5, 6)]
    assert cut_pieces(0, 4, 4, 2) == [(0, 0, 4)]


def test_the_simulator_knows_the_variant():
    from minidp.study.memory_model import predict_memory, zero1_beside_ddp
    from minidp.study.network import CLUSTER
    from minidp.study.simulate import Profile, simulate_step

    for n in (2, 4, 64):
        rows = zero1_beside_ddp(1000, n, k=8, weight_bytes=4, grad_bytes=4)
        ring = (n - 1) / n
        assert rows["reduce_scatter"]["sent"] == pytest.approx(2 * ring * 4000)  # DDP's bytes
        assert rows["broadcast"]["sent"] == pytest.approx(3 * ring * 4000)  # torch's ZeRO-1
        zero1 = predict_memory(1000, n, k=8, weight_bytes=4, grad_bytes=4)[1]
        assert all(rows[m]["total"] == zero1["total"] for m in rows)  # memory: ZeRO-1's
    profile = Profile(0.01, ["a", "b"], [0.005, 0.01], [4e7, 4e7], 0.01, 0.001, 0.002)
    steps = {z: simulate_step(profile, CLUSTER, 16, zero=z) for z in
             (None, "broadcast", "reduce_scatter", "reduce_scatter_overlap")}
    # comm: DDP's all-reduces = reduce-scatters + all-gather; torch's ZeRO-1 adds half of that
    assert steps["reduce_scatter"]["comm_s"] == pytest.approx(steps[None]["comm_s"], rel=0.05)
    assert steps["broadcast"]["comm_s"] == pytest.approx(1.5 * steps[None]["comm_s"], rel=0.05)
    assert steps["reduce_scatter_overlap"]["step_s"] < steps["reduce_scatter"]["step_s"] < \
        steps["broadcast"]["step_s"]
    with pytest.raises(ValueError, match="zero="):
        simulate_step(profile, CLUSTER, 16, zero="stage1")
