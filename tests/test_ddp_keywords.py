"""torch DDP's later keywords, each bitwise against torch DDP: one launch per world size for all cases.

Each case trains the same model under minidp.DDP and torch DDP with the same keywords and compares
what torch shows of its buckets (`_get_ddp_logging_data()`: the bucket sizes, the rebuilt layout),
which `.grad` are None after each step, and the final weights (torch.equal).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import minidp
from harness import run_ranks
from training import bitwise_equal, rank_batches, snapshot, train

STEPS = 6


class Stack(nn.Module):
    """Four layers of different sizes (a few KiB each): small caps cut them into several buckets.
    `skip` leaves the last layer out of forward (an unused parameter on every rank)."""

    def __init__(self, skip=False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 48), nn.Linear(48, 32)
        self.d, self.e = nn.Linear(32, 4), nn.Linear(32, 4)
        self.skip = skip

    def forward(self, x):
        h = torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))
        return self.d(h) if self.skip else self.d(h) + self.e(h)


def _torch_layout(model) -> dict:
    """What torch DDP reports of its buckets: sizes in bytes and, once rebuilt, parameter indices."""
    data = model._get_ddp_logging_data()
    return {"sizes": data.get("bucket_sizes"), "rebuilt": data.get("rebuilt_per_bucket_param_indices"),
            "rebuilt_sizes": data.get("rebuilt_bucket_sizes")}


def _minidp_layout(model, initial) -> dict:
    """minidp's buckets in torch's report format (torch reports the initial sizes, then the rebuilt)."""
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    index = {n: i for i, (n, _) in enumerate(model.module.named_parameters())}
    plan = model.bucket_plan()
    rebuilt = plan != initial
    return {"sizes": ", ".join(str(sum(sizes[n] for n in b)) for b in initial),
            "rebuilt": ", ".join(" ".join(str(index[n]) for n in b) for b in plan) if rebuilt else None,
            "rebuilt_sizes": ", ".join(str(sum(sizes[n] for n in b)) for b in plan) if rebuilt else None}


def _run(engine, build, kwargs, steps=STEPS):
    """Train `steps` steps: which .grad are None after each; then the layout and the weights."""
    torch.manual_seed(0)
    model = engine(build(), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = model.bucket_plan() if engine is minidp.DDP else None
    seen = []

    def record(step):
        seen.append([p.grad is None for p in model.module.parameters()])

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # counts every c10d collective
        train(model, opt, rank_batches(steps, dist.get_rank(), targets=(4, 4)), per_step=record)
    allreduces = sum(event.name == "c10d::allreduce_" for event in prof.events())
    # torch's report of the rebuilt buckets is updated by the forward after the rebuild: read at the end
    layout = _minidp_layout(model, initial) if initial is not None else _torch_layout(model)
    return {"layout": layout, "nones": seen, "params": snapshot(model.module), "allreduces": allreduces}


CASES = {
    "cap_list": (Stack, dict(bucket_cap_mb_list=[0.002, 0.006, 0.003])),
    "cap_list_one": (Stack, dict(bucket_cap_mb_list=[0.012], bucket_cap_mb=3)),
    "cap_list_unused": (lambda: Stack(skip=True),
                        dict(bucket_cap_mb_list=[0.001, 0.01], find_unused_parameters=True)),
    "cap_list_static": (Stack, dict(bucket_cap_mb_list=[0.02, 0.005], static_graph=True)),
    # `e` unused on every rank; 0.0005 MiB puts e.weight with d.bias, e.bias in a bucket of its own
    "skip_unused": (lambda: Stack(skip=True), dict(bucket_cap_mb=0.0005, find_unused_parameters=True,
                                                   skip_all_reduce_unused_params=True)),
    "no_skip_unused": (lambda: Stack(skip=True), dict(bucket_cap_mb=0.0005, find_unused_parameters=True)),
    "skip_used": (Stack, dict(skip_all_reduce_unused_params=True)),  # nothing unused: no change
}


def _worker():
    torch.set_num_threads(1)
    return {name: {"minidp": _run(minidp.DDP, build, kwargs), "torch": _run(TorchDDP, build, kwargs)}
            for name, (build, kwargs) in CASES.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return run_ranks(_worker, request.param, timeout=240)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("cap_list")] + ["no_skip_unused"])
def test_buckets_and_weights_are_torch_ddps(results, case):
    for rank_results in results:
        got, want = rank_results[case]["minidp"], rank_results[case]["torch"]
        assert got["layout"] == want["layout"]
        assert got["nones"] == want["nones"]
        assert bitwise_equal(got["params"], want["params"])
        assert got["allreduces"] == want["allreduces"]


@pytest.mark.parametrize("case", ["skip_unused", "skip_used"])
def test_skip_all_reduce_unused_params_skips_torch_ddps_buckets(results, case):
    for rank_results in results:
        got, want = rank_results[case]["minidp"], rank_results[case]["torch"]
        assert got["layout"] == want["layout"]
        assert got["nones"] == want["nones"]
        assert bitwise_equal(got["params"], want["params"])
        assert got["allreduces"] == want["allreduces"]  # the skipped bucket's all-reduce is not issued
    if case == "skip_unused":  # one all-reduce fewer a step than without the keyword
        plain = results[0]["no_skip_unused"]
        assert plain["minidp"]["allreduces"] == plain["torch"]["allreduces"]
        assert results[0][case]["minidp"]["allreduces"] == plain["minidp"]["allreduces"] - STEPS


@pytest.mark.parametrize("kwargs, error", [
    (dict(bucket_cap_mb_list="25"), TypeError), (dict(bucket_cap_mb_list=[1, -1]), ValueError),
    (dict(bucket_cap_mb_list=[float("inf")]), ValueError), (dict(bucket_cap_mb_list=[True]), TypeError),
    (dict(bucket_cap_mb_list=[1], bucket_cap_mb="auto"), ValueError),
    (dict(skip_all_reduce_unused_params="yes"), TypeError),
    (dict(skip_all_reduce_unused_params=True, static_graph=True), ValueError)])
def test_bad_keyword_values_are_refused_before_any_collective(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        minidp.DDP(nn.Linear(2, 2), **kwargs)  # no process group here: it raises before one is needed
