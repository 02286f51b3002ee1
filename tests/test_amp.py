"""--amp's float16 path: autocast + torch.amp.GradScaler on two ranks, with an inf on one rank only.

Why every rank skips the same steps: both engines average the gradients inside backward (all-reduce),
before scaler.step() unscales them and looks for infs. An inf or NaN in one rank's gradients makes the
sum, so every rank's averaged gradients, non-finite: every rank's scaler skips that step and halves its
scale, with no extra collective. The step below is the examples' (train_torchvision.train_one_epoch):
autocast forward and loss, scaler.scale(loss).backward(), scaler.step(opt), scaler.update().

The GPU-marked test runs it where --amp means float16 (two ranks on one GPU through gloo, which takes
CUDA tensors); the CPU test runs the same worker with float16 autocast and GradScaler("cpu"), so the
skip logic is checked on every machine. minidp and torch DDP run side by side and must agree bitwise.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minidp
from harness import run_ranks

STEPS, INF_STEP = 5, 2  # at INF_STEP rank 1's batch holds an inf


def _engine(name: str, device: torch.device):
    """(model, optimizer, scaler) for one engine, from the same seed on every rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    wrapped = (minidp.DDP if name == "minidp" else nn.parallel.DistributedDataParallel)(model, device_ids=ids)
    # A small initial scale: no overflow of its own in this net, so only the planted inf skips a step.
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9), \
        torch.amp.GradScaler(device.type, init_scale=256.0)


def _amp_worker(device_type: str) -> dict:
    """Per engine: (scale before, scale after, weights moved) for every step, and the final weights."""
    env = minidp.init(backend="gloo", timeout=60)  # two ranks on one GPU: NCCL needs one GPU per rank
    device = env.device if device_type == "cuda" else torch.device("cpu")
    rank = dist.get_rank()
    engines = {name: _engine(name, device) for name in ("minidp", "ddp")}
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own batches
    out = {name: {"steps": []} for name in engines}
    for step in range(STEPS):
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        if step == INF_STEP and rank == 1:
            x[0, 0] = float("inf")  # this rank's loss and gradients turn inf/NaN; rank 0's stay finite
        x, y = x.to(device), y.to(device)
        for name, (model, opt, scaler) in engines.items():
            before = [p.detach().clone() for p in model.parameters()]
            with torch.autocast(device.type, dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()  # averaged over the ranks here, the inf included
            scaler.step(opt)  # unscale_ finds the inf in the averaged gradients: skips on every rank
            scaler.update()
            moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            out[name]["steps"].append((scale, scaler.get_scale(), moved, bool(torch.isfinite(loss))))
    for name, (model, _, _) in engines.items():
        out[name]["weights"] = [p.detach().cpu() for p in model.parameters()]
    return out


def _check(results) -> None:
    for rank, out in enumerate(results):
        for name in ("minidp", "ddp"):
            steps = out[name]["steps"]
            assert [s[3] for s in steps] == [not (rank == 1 and i == INF_STEP) for i in range(STEPS)]
            skipped = [not moved for _, _, moved, _ in steps]
            assert skipped == [i == INF_STEP for i in range(STEPS)], (rank, name, steps)
            before, after, _, _ = steps[INF_STEP]
            assert after == before / 2  # the scaler backed off on this rank too
            # The same scales and skips on every rank and in both engines (only the losses' finiteness differs).
            assert [s[:3] for s in steps] == [s[:3] for s in results[0]["minidp"]["steps"]]
    for name in ("minidp", "ddp"):  # the ranks hold the same weights, and minidp's are torch DDP's
        for a, b in zip(results[0][name]["weights"], results[1][name]["weights"]):
            assert torch.equal(a, b)
    for a, b in zip(results[0]["minidp"]["weights"], results[0]["ddp"]["weights"]):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_fp16_grad_scaler_skips_a_one_rank_inf_on_every_rank_cuda():
    _check(run_ranks(_amp_worker, 2, "cuda", init=False, timeout=180))


def test_fp16_grad_scaler_skips_a_one_rank_inf_on_every_rank_cpu():
    _check(run_ranks(_amp_worker, 2, "cpu", init=False, timeout=180))
