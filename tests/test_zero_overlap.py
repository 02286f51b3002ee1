"""ZeroRedundancyOptimizer(overlap_with_ddp=True) with hook_with_zero_step: the step inside
backward.

The oracle is torch's own path: torch DDP + torch's ZeroRedundancyOptimizer + torch's
hook_with_zero_step (ddp_zero_hook.py). torch refuses gloo there (a precaution against a hang of its
*interleaved* variant, pytorch#62300); the tests let its constructor through by answering "nccl" to
its one backend check, and nothing else is changed: every step runs torch's code on gloo. Each case
trains 8 steps and compares the final weights bit for bit with:
  - torch's overlap path (torch DDP, torch ZeRO, torch's hook),
  - torch's hook and torch's ZeRO, unmodified, on minidp.DDP (they read `_has_rebuilt_buckets`,
    `process_group` and the GradBucket's index/parameters/gradients),
  - minidp's hook and ZeRO on torch DDP,
  - minidp's interleaved hook (buckets stepped in the first hook call after their all-reduce is
    done),
  - the plain step (minidp.DDP + minidp ZeRO, opt.step() after backward) from the step where the
    overlap path starts updating (the third; the fourth with static_graph=True).
"""
from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import ddp_zero_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from minidp.hooks import hook_with_zero_step, hook_with_zero_step_interleaved
from minidp.sharded.zero.bucket_assignment import assign_buckets
from training import mse, rank_batches, snapshot

STEPS = 8
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05})}
# name -> (optimizer, shard_buckets, static_graph, tied weights)
CASES = {"sgd": ("sgd", False, False, False), "adam": ("adam", False, False, False),
         "adamw": ("adamw", False, False, False),
         "adam_shard_buckets": ("adam", True, False, False),
         "adamw_static_graph": ("adamw", False, True, False),
         "sgd_tied": ("sgd", True, False, True)}


class Net(nn.Module):
    """Tensors of many sizes, in several DDP buckets (bucket_cap_mb below); `tied`: a shared
    weight."""

    def __init__(self, tied=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 32)
        self.b2, self.head = nn.Linear(32, 32), nn.Linear(32, 4)
        if tied:
            self.b2.weight = self.b.weight

    def forward(self, x):
        return self.head(torch.tanh(self.b2(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def torch_hook_on_gloo(model, zero, shard_buckets):
    """torch's hook_with_zero_step, past its gloo refusal (its constructor's only backend check)."""
    with mock.patch.object(ddp_zero_hook.dist, "get_backend", lambda group=None: "nccl"):
        return ddp_zero_hook.hook_with_zero_step(allreduce_hook, model, zero,
                                                 shard_buckets=shard_buckets)


ENGINES = {  # name -> (DDP, ZeRO, hook maker)
    "torch": (TorchDDP, TorchZero, torch_hook_on_gloo),
    "minidp": (minidp.DDP, minidp.ZeroRedundancyOptimizer,
               lambda m, z, s: hook_with_zero_step(allreduce_hook, m, z, shard_buckets=s)),
    "torch_zero_on_minidp_ddp": (minidp.DDP, TorchZero, torch_hook_on_gloo),
    "minidp_zero_on_torch_ddp": (TorchDDP, minidp.ZeroRedundancyOptimizer,
                                 lambda m, z, s: hook_with_zero_step(allreduce_hook, m, z,
                                                                     shard_buckets=s)),
    "minidp_interleaved": (minidp.DDP, minidp.ZeroRedundancyOptimizer,
                           lambda m, z, s: hook_with_zero_step_interleaved(allreduce_hook, m, z,
                                                                           shard_buckets=s)),
}


def _overlapped(engine, case, rank, timeline=False):
    ddp_cls, zero_cls, make_hook = ENGINES[engine]
    optim, shard_buckets, static_graph, tied = CASES[case]
    torch.manual_seed(0)
    net = Net(tied)
    model = ddp_cls(net, bucket_cap_mb=0.004, static_graph=static_graph)
    optimizer_class, defaults = OPTIMIZERS[optim]
    zero = zero_cls(net.parameters(), optimizer_class, overlap_with_ddp=True, **defaults)
    model.register_comm_hook(None, make_hook(model, zero, shard_buckets))
    recording = model.enable_timeline() if timeline else None
    for batch in rank_batches(STEPS, rank):
        zero.zero_grad()
        mse(model, batch).backward()  # the step happens in here, from the third step on
    out = {"weights": snapshot(net)}
    if recording is not None:
        out["events"] = recording.snapshot()
    return out


def _plain(case, rank):
    """minidp.DDP + minidp ZeRO, opt.step() after backward, from the step the overlap path starts
    at.

    The same hook averages (allreduce_hook divides by N; DDP's default multiplies by 1/N, which
    rounds differently at N=3), so any difference would be the step's."""
    optim, _, static_graph, tied = CASES[case]
    torch.manual_seed(0)
    net = Net(tied)
    model = minidp.DDP(net, bucket_cap_mb=0.004, static_graph=static_graph)
    optimizer_class, defaults = OPTIMIZERS[optim]
    zero = minidp.ZeroRedundancyOptimizer(net.parameters(), optimizer_class, **defaults)
    model.register_comm_hook(None, allreduce_hook)
    first_update = 3 if static_graph else 2
    for step, batch in enumerate(rank_batches(STEPS, rank)):
        zero.zero_grad()
        mse(model, batch).backward()
        if step >= first_update:
            zero.step()
    return snapshot(net)


def _checkpoint_and_errors(rank):
    """consolidate/state_dict after the overlap path trained; the errors before it is ready."""
    torch.manual_seed(0)
    net = Net()
    model = minidp.DDP(net, bucket_cap_mb=0.004)
    zero = minidp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, overlap_with_ddp=True,
                                          lr=0.01)
    new_group = {"params": [nn.Parameter(torch.ones(2))]}
    out = {"early": {"consolidate": error_of(zero.consolidate_state_dict),
                     "add_param_group": error_of(zero.add_param_group, new_group)}}
    plain = minidp.ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01)
    out["early"]["plain zero"] = error_of(hook_with_zero_step, allreduce_hook, model, plain)
    out["early"]["torch: plain zero"] = error_of(
        ddp_zero_hook.hook_with_zero_step, allreduce_hook, model,
        TorchZero(net.parameters(), torch.optim.Adam, lr=0.01))
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
    for batch in rank_batches(4, rank):
        zero.zero_grad()
        mse(model, batch).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["step_returns"] = zero.step()
    out["step_warning"] = [str(w.message) for w in caught]
    zero.consolidate_state_dict(to=0)
    out["state"] = zero.state_dict() if rank == 0 else None
    out["owned"] = sorted(i for i, p in enumerate(net.parameters()) if p in zero.optim.state)
    return out


def _worker():
    rank = dist.get_rank()
    out = {}
    for case in CASES:
        out[case] = {engine: _overlapped(engine, case, rank,
                                         timeline=(engine == "minidp" and case == "adam"))
                     for engine in ENGINES}
        out[case]["plain"] = _plain(case, rank)
    out["checkpoint"] = _checkpoint_and_errors(rank)
    return out


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def ranks(request):
    return run_ranks(_worker, request.param)


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", CASES)
def test_overlap_equals_torchs_and_the_plain_step_bitwise(ranks, case):
    torch.manual_seed(0)
    start = snapshot(Net(CASES[case][3]))
    for rank, out in enumerate(ranks):
        got = out[case]
        reference = got["torch"]["weights"]
        assert not _equal(reference, start), "torch's overlap path did not train"
        for engine in ("minidp", "torch_zero_on_minidp_ddp", "minidp_zero_on_torch_ddp",
                       "minidp_interleaved"):
            assert _equal(got[engine]["weights"], reference), (case, engine, rank)
        assert _equal(got["plain"], reference), (case, "plain step", rank)
    for out in ranks[1:]:
        # ranks agree
        assert _equal(out[case]["minidp"]["weights"], ranks[0][case]["minidp"]["weights"])


def test_timeline_shows_the_steps_inside_backward(ranks):
    """Each bucket this rank owns is stepped, and every owner's part is broadcast, before
    loss.backward() returns (finalize_end), in the last step recorded."""
    for rank, out in enumerate(ranks):
        events = out["adam"]["minidp"]["events"]
        returns = sorted(t for kind, t, _ in events if kind == "finalize_end")
        assert len(returns) == STEPS
        last_step = [e for e in events if returns[-2] < e[1] <= returns[-1]]
        last_backward = max(t for kind, t, _ in last_step if kind == "backward_end")
        spans = [(kind, t, f["name"]) for kind, t, f in last_step if kind in ("begin", "end")]
        assert spans and all(t > last_backward for _, t, _ in spans)  # in the last bucket's hook
        world_size = len(ranks)
        buckets = len({f["bucket"] for kind, _, f in last_step if kind == "launch"})
        assert buckets >= 3
        steps = {name for kind, _, name in spans
                 if kind == "end" and name.startswith("step bucket")}
        assert steps == {f"step bucket {b}" for b in range(buckets) if b % world_size == rank}, rank
        broadcasts = {name for kind, _, name in spans if name.startswith("broadcast")}
        assert broadcasts == {f"broadcast bucket {b} from rank {b % world_size}"
                              for b in range(buckets)}, rank
        ends = [name for kind, _, name in spans if kind == "end"]
        # every span ended before backward() returned
        assert sorted(ends) == sorted(steps | broadcasts)


def test_state_dict_and_early_errors_as_torchs(ranks):
    out = ranks[0]["checkpoint"]
    assert out["early"]["consolidate"] == (
        "RuntimeError", "This method should not be called until this ZeroRedundancyOptimizer "
        "instance has been fully initialized")
    assert out["early"]["add_param_group"] == (
        "RuntimeError", "ZeroRedundancyOptimizer with `overlap_with_ddp=True` only supports a "
        "single parameter group")
    assert out["early"]["plain zero"] == out["early"]["torch: plain zero"] == (
        "ValueError", "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to "
        "use this hook properly")
    assert out["step_returns"] is None
    assert out["step_warning"] == ["`step()` should not be included in the training loop when "
                                   "`overlap_with_ddp=True`"]
    state = out["state"]["state"]
    owned = sorted(i for r in ranks for i in r["checkpoint"]["owned"])
    # every parameter's state, once, on rank 0
    assert owned == list(range(8)) and sorted(state) == owned
    # steps 3 and 4 updated, 1 and 2 did not
    assert all(int(s["step"]) == 2 for s in state.values())


def test_bucket_assignment_rule_by_hand():
    """torch's rule: whole buckets round robin; shard_buckets cuts each below total/N, smallest
    first."""
    sizes = [[6, 2], [1], [3, 3, 3]]  # 18 elements; N=2: threshold 9
    buckets = [[torch.empty(n) for n in b] for b in sizes]
    whole = assign_buckets(buckets, 2, shard_buckets=False)
    assert [sorted(r) for r in whole] == [[0, 2], [1]]
    cut = assign_buckets(buckets, 2, shard_buckets=True)
    # by size: bucket 1 (1) -> rank 0; bucket 0 (8, below 9) -> rank 1 (load 0 < 1); bucket 2 is cut
    # before its third tensor (3 + 3 + 3 reaches 9): [3, 3] -> rank 0 (1 < 8), [3] -> rank 1 (0 has
    # a piece)
    assert {b: (a.offset, len(a.params)) for b, a in cut[0].items()} == {1: (0, 1), 2: (0, 2)}
    assert {b: (a.offset, len(a.params)) for b, a in cut[1].items()} == {0: (0, 2), 2: (2, 1)}
    three = [[torch.empty(n) for n in (5, 2, 6)]]
    one = assign_buckets(three, 3, shard_buckets=True)  # threshold 4.3
    assert [(b, a.offset, len(a.params)) for r in one for b, a in r.items()] == [
        (0, 0, 1), (0, 1, 1), (0, 2, 1)]
    with pytest.raises(RuntimeError, match="shard_buckets=True: bucket 0 would be cut into 3 "
                                           "pieces for 2 ranks"):
        assign_buckets(three, 2, shard_buckets=True)
