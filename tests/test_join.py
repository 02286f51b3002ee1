"""Uneven inputs: model.join() (and torch's Join) as torch DDP's, bit for bit. Real processes, gloo, CPU.

Ranks that run out of data keep shadowing the others' collectives until the last rank is done. Every
case runs side by side with torch DDP's join in the same processes, and all cases of one world size
share one launch (two_ranks, three_ranks below). At 3 ranks gloo's ring sums in an order that depends
on the bucket layout, so bitwise equality also checks that the joined ranks shadow the right buckets.

Debug mode under join() (joined ranks meet every debug check) is in test_debug.py, with debug mode;
world size 1 under join() in test_world_one.py, in that file's one 1-rank launch.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.overrides import TorchFunctionMode

import minidp
from harness import run_ranks
from models import WithUnused, build, input_shape
from training import max_abs_diff, mean_square, rank_batches, snapshot, train

ENGINES = {"minidp": minidp.DDP, "torch": TorchDDP}


# ---- one launch per world size; every case leaves the group usable for the next ------------------

@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_two_rank_worker, 2, timeout=300, collective_timeout=30)


@pytest.fixture(scope="module")
def three_ranks():
    return run_ranks(_three_rank_worker, 3, timeout=300, collective_timeout=30)


def _two_rank_worker():
    # throw_on_early_termination last: every rank raises at the same join notice (the group stays usable).
    return {"join": _join_worker((5, 7)), "static_graph": _static_graph_worker(), "throw": _throw_worker((3, 5))}


def _three_rank_worker():
    return {"join": _join_worker((5, 7, 6)), "static_graph": _static_graph_worker(),
            "buffers": _join_buffers_worker((7, 5, 6)), "zero": _zero_worker()}


# ---- uneven inputs: the trained values ------------------------------------------------------------

JOIN_CASES = {
    "mlp": ("mlp", {}),
    "mlp_divide_by_live_ranks": ("mlp", {"divide_by_initial_world_size": False}),
    "cnn_batchnorm": ("cnn_bn", {}),
}


def _train_with_join(engine, model_name, join_kwargs, n_batches):
    torch.manual_seed(0)
    model = engine(build(model_name), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = rank_batches(n_batches, dist.get_rank(), inputs=(4, *input_shape(model_name)), targets=None)
    with model.join(**join_kwargs):
        train(model, opt, batches, mean_square)
    return snapshot(model.module, buffers=True)


def _join_worker(batches_per_rank):
    n = batches_per_rank[dist.get_rank()]
    out = {}
    for name, (model_name, kwargs) in JOIN_CASES.items():
        ours = _train_with_join(minidp.DDP, model_name, kwargs, n)
        theirs = _train_with_join(TorchDDP, model_name, kwargs, n)
        out[name] = max_abs_diff(ours, theirs)
    return out


def _assert_join_equal(results):
    for rank, res in enumerate(results):
        assert set(res) == set(JOIN_CASES)
        for case, diff in res.items():
            assert diff == 0.0, f"rank {rank}, {case}: max abs difference from torch DDP's join {diff}"


def test_join_uneven_inputs_equals_torch_ddp_join_two_ranks(two_ranks):
    _assert_join_equal([res["join"] for res in two_ranks])


def test_join_uneven_inputs_equals_torch_ddp_join_three_ranks(three_ranks):
    _assert_join_equal([res["join"] for res in three_ranks])


# ---- join(throw_on_early_termination=True) --------------------------------------------------------

def _throw_on_early_termination(engine, n_batches):
    """join(throw_on_early_termination=True): (error type, message, steps done) on this rank."""
    torch.manual_seed(0)
    model = engine(build("mlp"))
    done = 0
    try:
        with model.join(throw_on_early_termination=True):
            for _ in range(n_batches):
                model(torch.randn(4, *input_shape("mlp"))).pow(2).mean().backward()
                done += 1
    except RuntimeError as exc:  # every rank raises at the same join notice, so the group stays usable
        return type(exc).__name__, str(exc), done
    return None, None, done


def _throw_worker(batches_per_rank):
    n = batches_per_rank[dist.get_rank()]
    return {label: _throw_on_early_termination(engine, n) for label, engine in (("torch", TorchDDP),
                                                                                  ("minidp", minidp.DDP))}


def test_join_throw_on_early_termination_raises_on_every_rank_as_torch_ddp(two_ranks):
    for rank, result in enumerate(res["throw"] for res in two_ranks):
        assert result["minidp"] == result["torch"], rank
        assert result["minidp"][0] == "RuntimeError" and result["minidp"][2] == 3  # the shorter rank's 3 steps
    assert "Rank 0 exhausted all inputs" in two_ranks[0]["throw"]["minidp"][1]
    assert "Detected at least one rank that exhausted inputs" in two_ranks[1]["throw"]["minidp"][1]


# ---- under static_graph=True: the joined ranks shadow the static graph's buckets ------------------

STATIC_STEPS = 5


def _train_uneven_static(engine):
    """Rank r trains STATIC_STEPS + 2r steps under join(), past the static graph's late rebuild."""
    torch.manual_seed(0)
    net = WithUnused()
    model = engine(net, static_graph=True, bucket_cap_mb=0.0008)  # several buckets once rebuilt
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = rank_batches(STATIC_STEPS + 2 * dist.get_rank(), dist.get_rank(), seed=1, inputs=(4, 6), targets=None)
    with model.join():
        train(model, opt, batches, mean_square)
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def _static_graph_worker():
    return torch.equal(_train_uneven_static(minidp.DDP), _train_uneven_static(TorchDDP))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_under_static_graph_bitwise_as_torch_ddp(world_size, request):
    results = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[world_size])
    for rank, res in enumerate(results):
        assert res["static_graph"], rank


# ---- buffers from the last rank still training, bit for bit, with no host sync -------------------

class _Buffered(nn.Module):
    """Rank-dependent buffers (signed zeros, NaN, bools) rewritten in every forward; BatchNorm too."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 4), nn.BatchNorm1d(4)
        self.register_buffer("signs", torch.zeros(3))
        self.register_buffer("flags", torch.zeros(2, dtype=torch.bool))
        self.received = []  # the buffers as each forward received them (after DDP's broadcast)

    def forward(self, x):
        self.received.append(torch.cat([self.signs.view(torch.int32).double(), self.flags.double()]))
        rank = dist.get_rank()
        self.signs.copy_(torch.tensor([-0.0 if rank != 1 else 0.0, float("nan") if rank == 1 else 2.0, rank + 0.5]))
        self.flags.copy_(torch.tensor([rank == 0, rank == 2]))
        return self.bn(self.lin(x))


class _HostSyncs(TorchFunctionMode):
    """Counts the tensor calls that make the host wait for a value (on a GPU: a stall)."""

    NAMES = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.NAMES
        return func(*args, **(kwargs or {}))


def _join_buffers_worker(batches_per_rank):
    n = batches_per_rank[dist.get_rank()]
    with _HostSyncs() as probe:  # the counter sees a host sync (else "0 host syncs" would prove nothing)
        torch.ones(1).item()
    out = {"probe": probe.count}
    for label, engine in ENGINES.items():
        torch.manual_seed(0)
        module = _Buffered()
        model = engine(module, bucket_cap_mb=0.0005)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(7 + dist.get_rank())
        syncs = _HostSyncs()
        with model.join():
            for step in range(n):
                x = torch.randn(4, 8, generator=gen)
                if step >= 2 and label == "minidp":  # after the one-time bucket rebuild
                    with syncs:
                        y = model(x)
                else:
                    y = model(x)
                y.pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        out[label] = (module.received, [t.detach().clone() for t in module.state_dict().values()])
        if label == "minidp":  # only minidp's forward is counted (torch DDP's reads a rank with .item())
            out["host_syncs"] = syncs.count
    return out


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_join_buffers_bitwise_as_torch_ddp_without_host_syncs(three_ranks):
    for rank, res in enumerate(r["buffers"] for r in three_ranks):
        (ours_received, ours_state), (theirs_received, theirs_state) = res["minidp"], res["torch"]
        assert len(ours_received) == len(theirs_received) == (7, 5, 6)[rank]
        for step, (a, b) in enumerate(zip(ours_received, theirs_received)):
            assert torch.equal(a, b), (rank, step, a, b)  # bit patterns: -0.0 and NaN included
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ours_state, theirs_state))
        assert res["probe"] == 1, "the host-sync counter missed a .item()"
        assert res["host_syncs"] == 0, f"rank {rank}: {res['host_syncs']} host syncs in forward under join()"


def _join_no_sync_on_gpu_worker():
    minidp.init(backend="nccl", timeout=60)  # the suite sets MINIDP_BACKEND=gloo: ask for NCCL by name
    device = torch.device("cuda", torch.cuda.current_device())
    model = minidp.DDP(build("cnn_bn").to(device), device_ids=[device.index])
    xs = [torch.randn(4, 3, 4, 4, device=device) for _ in range(4)]  # already on the device: no copy
    with model.join():
        for step, x in enumerate(xs):
            torch.cuda.synchronize()
            if step >= 2:  # after the one-time bucket rebuild
                torch.cuda.set_sync_debug_mode("error")  # any host sync in forward raises
            try:
                y = model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            y.pow(2).mean().backward()
    return True


@pytest.mark.gpu
def test_join_forward_makes_no_host_sync_on_gpu():
    assert run_ranks(_join_no_sync_on_gpu_worker, 1, init=False) == [True]


# ---- with torch's ZeroRedundancyOptimizer, joined together ----------------------------------------

def _zero_train(engine, uneven: bool):
    torch.manual_seed(0)
    net = build("mlp")
    model = engine(net, bucket_cap_mb=0.001)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)
    steps = 5 + (2 * dist.get_rank() if uneven else 0)
    with Join([model, opt]):  # both joinables: the wrapper's join hook and ZeRO's
        train(model, opt, rank_batches(steps, dist.get_rank(), seed=0, targets=None), mean_square)
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def _zero_worker():
    return [torch.equal(_zero_train(minidp.DDP, uneven), _zero_train(TorchDDP, uneven)) for uneven in (False, True)]


def test_zero_redundancy_optimizer_under_join_bitwise_as_torch_ddp(three_ranks):
    assert [res["zero"] for res in three_ranks] == [[True, True]] * 3
