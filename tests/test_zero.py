"""minidp.ZeroRedundancyOptimizer against torch's, its oracle: same weights, partition,
checkpoints, errors.

One launch per world size (1-4): the worker runs every case on its ranks and returns plain results;
the tests below only compare them. Training cases pair minidp.DDP + minidp's ZeRO with torch DDP +
torch's ZeRO (one case pairs both ZeROs with torch DDP), 20 steps from the same weights and batches,
with the lr halved midway through param_groups (as a scheduler does), and end bitwise equal.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from minidp.sharded.zero import partition
from training import rank_batches, snapshot, train

STEPS = 20
MinidpZero = minidp.ZeroRedundancyOptimizer
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.05}),
}


class Case(NamedTuple):
    optim: str
    # two groups: weights (lr 0.05, weight_decay 0.01) and biases (lr 0.02, none)
    groups: bool = False
    bucket_view: bool = False  # parameters_as_bucket_view
    tied: bool = False  # a model with one weight shared by two layers
    late_group: bool = False  # the head joins through add_param_group() at step 5
    torch_ddp: bool = False  # both ZeROs beside torch DDP (else minidp's beside minidp.DDP)
    tiny: bool = False  # one Linear: two parameters, so at 3 and 4 ranks some ranks own nothing
    # process_group = ranks 1.. (3 and 4 ranks only): group ranks are not global ones
    subgroup: bool = False


CASES = {
    "sgd-groups": Case("sgd", groups=True),
    "sgd-groups-bucket": Case("sgd", groups=True, bucket_view=True),
    "adam-groups-bucket": Case("adam", groups=True, bucket_view=True),
    "adam-tied": Case("adam", tied=True),
    "adamw-groups": Case("adamw", groups=True),
    "adamw-tied-bucket": Case("adamw", tied=True, bucket_view=True),
    "sgd-add-group-bucket": Case("sgd", bucket_view=True, late_group=True),
    "adam-beside-torch-ddp": Case("adam", groups=True, bucket_view=True, torch_ddp=True),
    "sgd-tiny-bucket": Case("sgd", tiny=True, bucket_view=True),
    "adam-subgroup": Case("adam", groups=True, subgroup=True),
    "adamw-subgroup-bucket": Case("adamw", subgroup=True, bucket_view=True),
}


class Net(nn.Module):
    """Parameters of many sizes (so the partition has choices to make); `tied`: two layers share a
    weight."""

    def __init__(self, tied=False):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.b2 = nn.Linear(32, 32)
        if tied:
            self.b2.weight = self.b.weight

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.head(torch.tanh(self.b2(h)))


def _net(tied=False, tiny=False):
    torch.manual_seed(0)
    return nn.Linear(8, 4) if tiny else Net(tied)


def _params(net, case):
    if case.tiny:
        return list(net.parameters())
    params = [p for name, p in net.named_parameters()
              if not (case.late_group and name.startswith("head"))]
    if not case.groups:
        return params
    weights = [p for p in params if p.dim() == 2]
    biases = [p for p in params if p.dim() == 1]
    return [{"params": weights, "lr": 0.05, "weight_decay": 0.01},
            {"params": biases, "lr": 0.02, "weight_decay": 0.0}]


def _hyperparameters(param_groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in param_groups]


def _train_case(case, zero_cls, ddp_cls, rank, group=None):
    net = _net(case.tied, case.tiny)
    model = ddp_cls(net, process_group=group)
    optimizer_class, defaults = OPTIMIZERS[case.optim]
    opt = zero_cls(_params(net, case), optimizer_class, process_group=group,
                   parameters_as_bucket_view=case.bucket_view, **defaults)

    def per_step(step):
        if step == STEPS // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5  # what an LR scheduler does: the local optimizer must follow
        if case.late_group and step == 5:
            opt.add_param_group({"params": list(net.head.parameters()), "lr": 0.03})

    train(model, opt, rank_batches(STEPS, rank), per_step=per_step)
    # the last rank of the group: `to` and group ranks are honoured
    to = dist.get_world_size(group) - 1
    opt.consolidate_state_dict(to=to)
    return {"weights": snapshot(net), "param_groups": _hyperparameters(opt.param_groups),
            "state": opt.state_dict() if dist.get_rank(group) == to else None}


def _training(rank):
    world_size = dist.get_world_size()
    # every rank creates the group (new_group is collective); ranks outside it skip its cases
    subgroup = dist.new_group(list(range(1, world_size))) if world_size >= 3 else None
    out = {}
    for name, case in CASES.items():
        if case.subgroup and (subgroup is None or rank == 0):
            out[name] = None
            continue
        group = subgroup if case.subgroup else None
        mine_ddp = TorchDDP if case.torch_ddp else minidp.DDP
        out[name] = {"minidp": _train_case(case, minidp.ZeroRedundancyOptimizer, mine_ddp, rank,
                                           group),
                     "torch": _train_case(case, TorchZero, TorchDDP, rank, group)}
    return out


def _owned(opt, net):
    """Which parameters (by index in net.parameters()) this rank's local optimizer steps, group by
    group."""
    index = {p: i for i, p in enumerate(net.parameters())}
    return [[index[p] for p in g["params"]] for g in opt.optim.param_groups]


def _partition():
    net = _net()
    groups = _params(net, Case("sgd", groups=True, late_group=True))
    late = {"params": list(net.head.parameters()), "lr": 0.1}
    owned = {}
    for name, cls in (("minidp", minidp.ZeroRedundancyOptimizer), ("torch", TorchZero)):
        opt = cls(copy.copy(groups), torch.optim.SGD, lr=0.1)
        before = _owned(opt, net)
        opt.add_param_group(dict(late))
        ungrouped = cls(list(net.parameters()), torch.optim.SGD, lr=0.1)
        owned[name] = {"ungrouped": _owned(ungrouped, net),
                       "groups": before, "added": _owned(opt, net)}
    return owned


def _state_dict_everywhere(opt, to):
    """Consolidate on `to`, then hand its state dict to every rank (load_state_dict runs on all)."""
    opt.consolidate_state_dict(to=to)
    box = [opt.state_dict() if dist.get_rank() == to else None]
    dist.broadcast_object_list(box, src=to)
    return box[0]


def _one_step(model, opt, batch):
    F.mse_loss(model(batch[0]), batch[1]).backward()
    opt.step()
    opt.zero_grad()


def _checkpoint(src_cls, dst_cls, bucket_view, rank):
    """src trains 5 steps and saves; dst loads that and src's weights; both take one more step:
    equal?"""
    to = dist.get_world_size() - 1  # not rank 0: `to` is honoured
    batches = rank_batches(6, rank, seed=7)
    ends = []
    # dst trains too, on other batches: its DDP must have rebuilt its buckets as src's did (at 3 and
    # 4 ranks the bucket layout changes gloo's summation order), and load_state_dict must replace
    # its state
    for cls, own_batches in ((src_cls, batches[:5]), (dst_cls, rank_batches(5, rank, seed=9))):
        net = _net()
        model = minidp.DDP(net)
        opt = cls(_params(net, Case("adam", groups=True)), torch.optim.Adam, lr=0.01,
                  parameters_as_bucket_view=bucket_view)
        train(model, opt, own_batches)
        ends.append((net, model, opt))
    (src_net, src_model, src_opt), (dst_net, dst_model, dst_opt) = ends
    saved = _state_dict_everywhere(src_opt, to)
    with torch.no_grad():
        for p, q in zip(dst_net.parameters(), src_net.parameters()):
            p.copy_(q)
    # torch's load clears other ranks' entries in its argument
    dst_opt.load_state_dict(copy.deepcopy(saved))
    for model, opt in ((src_model, src_opt), (dst_model, dst_opt)):
        _one_step(model, opt, batches[5])
    return {"weights": (snapshot(src_net), snapshot(dst_net)),
            "state": (_state_dict_everywhere(src_opt, to), _state_dict_everywhere(dst_opt, to)),
            "saved_steps": sorted(saved["state"])}


def _bad_arguments():
    """(case, minidp's error, torch's error) for each bad input; errors as (type name, message)."""
    p = nn.Linear(2, 2).weight
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (2,), requires_grad=True)
    from torch.distributed.optim.functional_sgd import _FunctionalSGD
    cases = {
        "tensor": ((p, torch.optim.SGD), {"lr": 0.1}),
        "not iterable": ((5, torch.optim.SGD), {"lr": 0.1}),
        "empty": (([], torch.optim.SGD), {"lr": 0.1}),
        "mixed": (([p, {"params": [p]}], torch.optim.SGD), {"lr": 0.1}),
        "group without params": (([{"lr": 0.1}], torch.optim.SGD), {"lr": 0.1}),
        "sparse": (([sparse], torch.optim.SGD), {"lr": 0.1}),
        "two dtypes": (([p, nn.Linear(2, 2).double().weight], torch.optim.SGD), {"lr": 0.1}),
        "functional optimizer": (([p], _FunctionalSGD), {"lr": 0.1}),
        "negative lr": (([p], torch.optim.SGD), {"lr": -1.0}),
        "unknown keyword": (([p], torch.optim.SGD), {"lr": 0.1, "bogus": 1}),
        "non-leaf": (([p * 2], torch.optim.SGD), {"lr": 0.1}),
    }
    out = {name: (error_of(minidp.ZeroRedundancyOptimizer, *args, **kw),
                  error_of(TorchZero, *args, **kw))
           for name, (args, kw) in cases.items()}
    late = {}
    for cls in (minidp.ZeroRedundancyOptimizer, TorchZero):
        opt = cls([p], torch.optim.SGD, lr=0.1)
        late[cls] = (error_of(opt.state_dict), error_of(opt.add_param_group, {"params": [p]}),
                     error_of(opt.load_state_dict, {"state": {}, "param_groups": []}))
    for i, what in enumerate(("state_dict before consolidate", "add_param_group twice",
                              "load two groups")):
        out[what] = (late[minidp.ZeroRedundancyOptimizer][i], late[TorchZero][i])
    out["optimizer_class not callable"] = (error_of(MinidpZero, [p], "sgd", lr=0.1),
                                           error_of(TorchZero, [p], "sgd", lr=0.1))
    # overlap_with_ddp=True: a functional optimizer is accepted (it is turned into its torch.optim
    # class); more than one group fails at construction (torch: in the third backward, with the same
    # sentence)
    out["overlap, functional optimizer"] = (error_of(MinidpZero, [p], _FunctionalSGD,
                                                     overlap_with_ddp=True, lr=0.1), None)
    two_groups = [{"params": [p]}, {"params": [nn.Linear(2, 2).weight]}]
    out["overlap, two groups"] = (error_of(MinidpZero, two_groups, torch.optim.SGD,
                                           overlap_with_ddp=True, lr=0.1), None)
    return out


def _closure_and_zero_grad(rank):
    """step(closure) returns the closure's loss; zero_grad(set_to_none=False) zeroes every rank's
    grads."""
    x, y = rank_batches(1, rank)[0]
    out = {}
    for name, cls in (("minidp", minidp.ZeroRedundancyOptimizer), ("torch", TorchZero)):
        net = _net()
        opt = cls(net.parameters(), torch.optim.SGD, lr=0.1)

        def closure(opt=opt, net=net):
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            loss.backward()
            return loss

        loss = opt.step(closure)
        opt.zero_grad(set_to_none=False)
        index = {p: i for i, p in enumerate(net.parameters())}
        # torch's private _all_params (its own Join tests read it): the constructor's parameters, in
        # order
        out[name] = (loss.detach(), snapshot(net), [p.grad for p in net.parameters()],
                     [index[p] for p in opt._all_params])
    return out


def _uneven_inputs(rank):
    """Rank r has 3 + r batches, under Join([model, optimizer]): a joined rank still steps its shard
    and broadcasts it (the join hook) while the others train on."""
    out = {}
    for name, zero_cls, ddp_cls in (("minidp", minidp.ZeroRedundancyOptimizer, minidp.DDP),
                                    ("torch", TorchZero, TorchDDP)):
        net = _net()
        model = ddp_cls(net)
        opt = zero_cls(net.parameters(), torch.optim.Adam, lr=0.01)
        with Join([model, opt]):
            for batch in rank_batches(3 + rank, rank):
                _one_step(model, opt, batch)
        out[name] = snapshot(net)
    return out


def _worker():
    rank = dist.get_rank()
    return {"uneven": _uneven_inputs(rank), "training": _training(rank), "partition": _partition(),
            "closure": _closure_and_zero_grad(rank),
            "checkpoint": {"torch->minidp": _checkpoint(TorchZero, MinidpZero, False, rank),
                           "minidp->torch": _checkpoint(MinidpZero, TorchZero, True, rank)},
            "errors": _bad_arguments()}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def ranks(request):
    """Every rank's results at one world size: one launch runs every case."""
    return run_ranks(_worker, request.param)


def _same(a, b):
    """Equal values, tensors bit for bit (and dtype), through dicts, lists and tuples."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("case", CASES)
def test_training_equals_torch_zero_bitwise(ranks, case):
    results = [out["training"][case] for out in ranks if out["training"][case] is not None]
    if not results:
        pytest.skip("a subgroup of ranks 1.. needs 3 ranks or more")
    states = [got["minidp"]["state"] for got in results if got["minidp"]["state"] is not None]
    assert len(states) == 1  # the consolidated state is on the `to` rank only
    for rank, got in enumerate(results):
        assert _same(got["minidp"]["weights"], got["torch"]["weights"]), (case, rank)
        assert got["minidp"]["param_groups"] == got["torch"]["param_groups"], (case, rank)
        # torch's format, equal
        assert _same(got["minidp"]["state"], got["torch"]["state"]), (case, rank)
        # every rank ends with every updated weight (the broadcasts)
        assert _same(got["minidp"]["weights"], results[0]["minidp"]["weights"]), (case, rank)


def test_partition_equals_torchs(ranks):
    for rank, out in enumerate(ranks):
        assert out["partition"]["minidp"] == out["partition"]["torch"], rank
    # each of Net's 8 parameters is stepped by exactly one rank
    owned = sorted(i for out in ranks for group in out["partition"]["minidp"]["ungrouped"]
                   for i in group)
    assert owned == list(range(8))


def test_partition_rule_by_hand():
    """Largest first, each to the least-loaded rank (lowest on a tie), loads carried across
    groups."""
    sizes = [3, 5, 2, 3]  # sorted: 5 (index 1), 3 (0), 3 (3), 2 (2); a stable sort keeps 0 before 3
    groups = [{"params": [torch.zeros(n) for n in sizes], "lr": 0.1},
              {"params": [torch.zeros(4)], "lr": 0.2}]
    got = partition.partition_parameters(groups, 2)
    ids = {id(p): i for i, p in enumerate(groups[0]["params"] + groups[1]["params"])}
    as_ids = [[[ids[id(p)] for p in g["params"]] for g in rank] for rank in got]
    # rank 0: 5, then 2 (loads 5|3 -> 5|6 -> 7|6); group 2's tensor goes to rank 1 (7 > 6)
    assert as_ids == [[[1, 2], []], [[0, 3], [4]]]
    assert [g["lr"] for g in got[1]] == [0.1, 0.2]


def test_uneven_inputs_under_join_as_torchs(ranks):
    for rank, out in enumerate(ranks):
        assert _same(out["uneven"]["minidp"], out["uneven"]["torch"]), rank
        assert _same(out["uneven"]["minidp"], ranks[0]["uneven"]["minidp"]), rank


def test_closure_and_zero_grad_as_torchs(ranks):
    for rank, out in enumerate(ranks):
        theirs = out["closure"]["torch"]
        (loss, weights, grads, all_params) = out["closure"]["minidp"]
        assert _same((loss, weights, grads, all_params), theirs), rank
        assert all_params == list(range(len(weights))), rank
        assert all(g is not None and not g.any() for g in grads), rank


@pytest.mark.parametrize("direction", ["torch->minidp", "minidp->torch"])
def test_checkpoint_moves_between_torch_and_minidp(ranks, direction):
    for rank, out in enumerate(ranks):
        got = out["checkpoint"][direction]
        assert got["saved_steps"] == list(range(8)), rank  # every parameter's state was saved
        src, dst = got["weights"]
        assert _same(src, dst), (direction, rank)
        assert _same(*got["state"]), (direction, rank)


def test_bad_arguments_raise_torchs_errors(ranks):
    errors = ranks[0]["errors"]
    for case, (mine, theirs) in errors.items():
        if case == "overlap, two groups":
            assert mine[0] == "RuntimeError", mine
            assert "only supports a single parameter group" in mine[1], mine
            assert "got 2 parameter groups" in mine[1], mine
        elif case == "overlap, functional optimizer":
            assert mine is None
        elif case == "optimizer_class not callable":
            assert mine[0] == theirs[0] == "TypeError" and "optimizer_class='sgd'" in mine[1]
        else:
            assert theirs is not None and mine == theirs, case
