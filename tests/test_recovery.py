"""A backward that raises (on every rank, or on one rank only) and is caught by the training loop.

torch DDP refuses every later step ("Expected to have finished reduction in the prior iteration").
minidp closes the failed iteration at the next forward: the failing rank launches the buckets it had
not, every rank learns from the end-of-backward status all-reduce that the iteration failed, and
ranks whose backward succeeded raise too. Every rank's loop then skips the same step, so training
goes on with the ranks equal: bitwise equal to torch DDP trained on the same batches minus that step.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp.engine.failures import status_on_host
from training import bitwise_equal, offset_by_rank, shard_of, snapshot

STEPS, SHARD = 6, 4
CAP_MB = 0.004  # two buckets once rebuilt: the failure falls between them (one launched, one not)


class RaiseInBackward(torch.autograd.Function):
    """Identity in forward; raises in backward while `armed` (set per step by the loop)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if RaiseInBackward.armed:
            raise RuntimeError("test: backward failed on purpose")
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):  # backward reaches c and b, then raises before a
        return self.c(torch.tanh(self.b(RaiseInBackward.apply(torch.tanh(self.a(x))))))


def _scenarios(world_size):
    last = world_size - 1
    return {
        "every_rank": {"step": 2, "ranks": list(range(world_size))},
        "one_rank": {"step": 3, "ranks": [1]},
        "one_rank_first_iteration": {"step": 0, "ranks": [last]},  # one bucket, before the rebuild
        "one_rank_find_unused_bucket_view": {"step": 2, "ranks": [0],
                                             "ddp": {"find_unused_parameters": True,
                                                     "gradient_as_bucket_view": True}},
        # failures.status_on_host: the status on CPU tensors over a gloo copy of the group (no GPU read)
        "one_rank_status_on_host": {"step": 3, "ranks": [last], "host_status": True},
        "one_rank_find_unused_status_on_host": {"step": 2, "ranks": [0], "host_status": True,
                                                "ddp": {"find_unused_parameters": True}},
    }


def _train(engine, cfg, fail: bool, steps=STEPS):
    """Train; on the failing step, the failing ranks raise in backward (fail=True) or every rank skips it.

    Its own loop, not tests/training.train: catching a backward's error and skipping that step is what
    this file tests.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = offset_by_rank(Net(), rank)
    wrapped = engine(model, bucket_cap_mb=CAP_MB, **cfg.get("ddp", {}))
    if cfg.get("host_status") and engine is minidp.DDP:
        status_on_host(wrapped)  # ranks meet here (a new gloo group)
        assert wrapped.reducer.status_group is not None
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    gen, errors = torch.Generator().manual_seed(1234), []
    for step in range(steps):
        x, y = shard_of((torch.randn(world_size * SHARD, 8, generator=gen),
                         torch.randn(world_size * SHARD, 4, generator=gen)), rank, SHARD)
        if step == cfg["step"] and not fail:
            continue  # the reference: this step never happened
        RaiseInBackward.armed = fail and step == cfg["step"] and rank in cfg["ranks"]
        try:
            nn.functional.mse_loss(wrapped(x), y).backward()
        except RuntimeError as exc:  # the loop skips the step, as after a caught out-of-memory
            errors.append((step, str(exc)))
            opt.zero_grad()
            continue
        finally:
            RaiseInBackward.armed = False
        opt.step()
        opt.zero_grad()
    return snapshot(model), errors


def _nan_gradients(engine):
    """One step whose loss is NaN on rank 0 only: every averaged gradient is NaN, and no rank failed."""
    torch.manual_seed(0)
    model = engine(Net())
    x = torch.randn(SHARD, 8)
    if dist.get_rank() == 0:
        x[0, 0] = float("nan")
    model(x).sum().backward()  # must not raise: a NaN is not a failure
    return [p.grad.view(torch.int32).clone() for p in model.parameters()]  # bits: NaN == NaN


def _worker():
    out = {"nan_gradients_equal": bitwise_equal(_nan_gradients(minidp.DDP), _nan_gradients(TorchDDP))}
    for name, cfg in _scenarios(dist.get_world_size()).items():
        ours, errors = _train(minidp.DDP, cfg, fail=True)
        reference, _ = _train(TorchDDP, cfg, fail=False)
        out[name] = {"equal": bitwise_equal(ours, reference), "errors": errors}
    # torch DDP itself, failing on every rank: it refuses every later step.
    out["torch_ddp"] = _train(TorchDDP, _scenarios(dist.get_world_size())["every_rank"], fail=True, steps=5)[1]
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def results(request):
    return request.param, run_ranks(_worker, request.param, timeout=240, collective_timeout=30)


@pytest.mark.parametrize("scenario", ["every_rank", "one_rank", "one_rank_first_iteration",
                                      "one_rank_find_unused_bucket_view", "one_rank_status_on_host",
                                      "one_rank_find_unused_status_on_host"])
def test_training_goes_on_with_equal_ranks(results, scenario):
    world_size, per_rank = results
    cfg = _scenarios(world_size)[scenario]
    for rank, result in enumerate(per_rank):
        res = result[scenario]
        # Equal to torch DDP without the failed step, so equal across ranks, bitwise.
        assert res["equal"], f"{scenario}, rank {rank}: parameters differ from torch DDP without step {cfg['step']}"
        assert [step for step, _ in res["errors"]] == [cfg["step"]], res["errors"]  # every rank, once
        message = res["errors"][0][1]
        if rank in cfg["ranks"]:
            assert "failed on purpose" in message
        else:
            assert f"raised on rank(s) {cfg['ranks']}" in message and "Skip optimizer.step()" in message


def test_a_nan_gradient_is_not_a_failure(results):
    """A NaN in the last bucket makes the ranks exchange their status, which says nobody failed."""
    _, per_rank = results
    assert all(result["nan_gradients_equal"] for result in per_rank)


def test_torch_ddp_refuses_later_steps(results):
    _, per_rank = results
    for errors in (result["torch_ddp"] for result in per_rank):
        assert [step for step, _ in errors] == [2, 3, 4]
        assert all("Expected to have finished reduction in the prior iteration" in m for _, m in errors[1:])


def test_status_on_host_checks_its_model():
    with pytest.raises(TypeError, match=r"status_on_host: model=Linear must be a minidp.DDP"):
        status_on_host(nn.Linear(2, 2))
