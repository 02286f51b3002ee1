"""A step costs what torch DDP's step costs: the same collectives, counted by torch's profiler.

torch's profiler records every c10d collective (`c10d::allreduce_`, `c10d::broadcast_`, ...), whether
minidp's Python or torch DDP's C++ reducer issued it, so both engines are counted the same way: one
synced step (forward, backward, optimizer step) after the bucket rebuild, on every rank.
"""
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.profiler import ProfilerActivity, profile

import minidp
from harness import run_ranks
from models import MLP, CNNWithBatchNorm, UnusedBranch

WARM_STEPS = 3  # the first step, the rebuild before the second, then steady steps

# name -> (model builder, input shape, DDP keywords); each runs under both engines
CASES = {
    "default": (MLP, (8,), {}),
    "small_buckets": (lambda: MLP(width=64), (8,), {"bucket_cap_mb": 0.01}),
    "buffers": (CNNWithBatchNorm, (3, 4, 4), {}),
    "bucket_view": (MLP, (8,), {"gradient_as_bucket_view": True}),
    "find_unused": (UnusedBranch, (8,), {"find_unused_parameters": True}),
}


def _collectives_of_one_step(engine, build, shape, kwargs) -> dict:
    """{collective op name: count} for one step after WARM_STEPS, on this rank."""
    torch.manual_seed(0)
    model = engine(build(), **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, *shape), torch.randn(4, 4)

    def step():
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(WARM_STEPS):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = {}
    for event in prof.events():
        if event.name.startswith("c10d::"):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def _worker():
    engines = {"minidp": minidp.DDP, "torch": TorchDDP}
    return {name: {key: _collectives_of_one_step(engine, build, shape, kwargs) for key, engine in engines.items()}
            for name, (build, shape, kwargs) in CASES.items()}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def counted(request):
    return run_ranks(_worker, request.param, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_issues_the_collectives_torch_ddp_issues(counted, case):
    for rank, result in enumerate(counted):
        ours, theirs = result[case]["minidp"], result[case]["torch"]
        assert sum(theirs.values()) > 0, f"{case}: torch DDP issued no collective: the count sees nothing"
        assert ours == theirs, f"{case}, rank {rank}: minidp {ours}, torch DDP {theirs}"
