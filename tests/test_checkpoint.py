"""Checkpoints: integrity, atomic replacement, and kill-and-resume with nothing lost or repeated."""
import io
import os
import random
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import minidp
from harness import run_ranks
from minidp.train.checkpoint import HEADER_BYTES, read_verified

# ---- integrity and atomic replacement (one process) --------------------------------------------


def _small_state(seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_model_optimizer_step_and_rng(tmp_path):
    model, opt = _small_state(0)
    path = tmp_path / "ckpt.pt"
    minidp.save_checkpoint(path, model, opt, step=7, epoch=2, extra={"note": "hi"})
    expected_draw = torch.rand(3)
    fresh, fresh_opt = _small_state(1)
    payload = minidp.load_checkpoint(path, fresh, fresh_opt)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG is back where it was at save time
    assert (payload["step"], payload["epoch"], payload["extra"]) == (7, 2, {"note": "hi"})
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"],
                       fresh_opt.state_dict()["state"][0]["momentum_buffer"])


def _draws():
    import numpy as np

    return torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist()


@pytest.mark.parametrize("map_location", ["cpu", lambda storage, location: storage, {"cpu": "cpu"}, None])
def test_rng_restored_bitwise_whatever_map_location(tmp_path, map_location):
    # map_location decides where torch.load puts every tensor, the generator states included;
    # set_rng_state takes them back to the CPU (on a GPU machine: tests/test_gpu.py, map_location="cuda").
    model, _ = _small_state(0)
    path = tmp_path / "ckpt.pt"
    minidp.save_checkpoint(path, model)
    expected = _draws()
    _draws()  # move every generator on
    minidp.load_checkpoint(path, model, map_location=map_location)
    assert _draws() == expected  # torch, python and numpy generators, bitwise
    (state,) = minidp.train.checkpoint.read_checkpoint(path)["rng"]
    assert state["torch"].dtype == torch.uint8 and ("cuda" in state) == torch.cuda.is_available()


@pytest.mark.parametrize("cut", [0, 5, HEADER_BYTES - 1, HEADER_BYTES, HEADER_BYTES + 100, -1])
def test_truncated_checkpoint_is_rejected(tmp_path, cut):
    model, opt = _small_state(0)
    path = tmp_path / "ckpt.pt"
    minidp.save_checkpoint(path, model, opt)
    data = path.read_bytes()
    broken = tmp_path / "broken.pt"
    broken.write_bytes(data[:cut] if cut >= 0 else data[:len(data) + cut])
    with pytest.raises(ValueError, match="not a minidp checkpoint|truncated"):
        minidp.load_checkpoint(broken, model)
    assert path.read_bytes() == data  # the good one is untouched


def test_corrupt_checkpoint_is_rejected(tmp_path):
    model, _ = _small_state(0)
    path = tmp_path / "ckpt.pt"
    minidp.save_checkpoint(path, model)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt: SHA-256 mismatch"):
        minidp.load_checkpoint(path, model)


def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first, _ = _small_state(0)
    path = tmp_path / "ckpt.pt"
    minidp.save_checkpoint(path, first, step=1)
    second, _ = _small_state(1)

    def crash(*args):
        raise OSError("disk full (simulated) before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        minidp.save_checkpoint(path, second, step=2)
    monkeypatch.undo()
    restored, _ = _small_state(2)
    assert minidp.load_checkpoint(path, restored)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), restored.parameters()))
    minidp.save_checkpoint(path, second, step=3)  # a later good save keeps the previous as .prev
    assert minidp.load_checkpoint(str(path) + ".prev", restored)["step"] == 1


@pytest.mark.parametrize("call, error, words", [
    (lambda d: minidp.save_checkpoint(3.5, nn.Linear(2, 2)), TypeError, ["path=3.5"]),
    (lambda d: minidp.save_checkpoint(d / "x.pt", "model"), TypeError, ["model=str"]),
    (lambda d: minidp.save_checkpoint(d / "x.pt", nn.Linear(2, 2), step=-1), ValueError, ["step=-1", ">= 0"]),
    (lambda d: minidp.save_checkpoint(d / "x.pt", nn.Linear(2, 2), step=1.5), TypeError, ["step=1.5", "an int"]),
    (lambda d: minidp.save_checkpoint(d / "x.pt", nn.Linear(2, 2), epoch=True), TypeError, ["epoch=True"]),
    (lambda d: minidp.load_checkpoint("/nonexistent/x.pt", nn.Linear(2, 2)), FileNotFoundError,
     ["/nonexistent/x.pt"]),
], ids=["path", "model", "step_negative", "step_float", "epoch_bool", "missing"])
def test_bad_input_is_named(tmp_path, call, error, words):
    with pytest.raises(error) as info:
        call(tmp_path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"  # not a subclass
    assert all(word in str(info.value) for word in words), str(info.value)
    assert not (tmp_path / "x.pt").exists()  # refused before anything is written


# ---- kill at a random step, resume, compare with an uninterrupted run ---------------------------

SAMPLES, BATCH, EPOCHS = 40, 4, 2  # 5 steps per rank per epoch at world size 2


def _resumable_training(run_id, ckpt_path, log_path, kill_at):
    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # dropout draws differ per rank: their RNG must be restored exactly
    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(SAMPLES, 8, generator=gen), torch.randn(SAMPLES, 4, generator=gen),
                         torch.arange(SAMPLES))
    torch.manual_seed(0)
    model = minidp.DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4)))
    torch.manual_seed(1000 + rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    sampler = minidp.DistributedSampler(data, seed=3)
    # Its own generator: iter(loader) draws a seed, which must not shift the global RNG on resume.
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    step, start_epoch = 0, 0
    if os.path.exists(ckpt_path):
        payload = minidp.load_checkpoint(ckpt_path, model, opt, sched, sampler)
        step, start_epoch = payload["step"], payload["epoch"]
    for epoch in range(start_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            with open(f"{log_path}.rank{rank}", "a") as f:
                f.write(f"{run_id} {epoch} {step} {' '.join(map(str, index.tolist()))}\n")
            if step == kill_at and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # dies before this step's checkpoint
            minidp.save_checkpoint(ckpt_path, model, opt, sched, sampler, step=step, epoch=epoch)
    return [p.detach().clone() for p in model.parameters()]


def _served(log_path, rank):
    """{(run, step): (epoch, indices)} from one rank's log."""
    out = {}
    with open(f"{log_path}.rank{rank}") as f:
        for line in f:
            run, epoch, step, *indices = line.split()
            out[(run, int(step))] = (int(epoch), [int(i) for i in indices])
    return out


# Where rank 1 is killed, one run after the other, each resuming from the last checkpoint: in the middle
# of epoch 0; at the first step of epoch 1 (so the next run resumes from the checkpoint of epoch 0's last
# step, whose sampler has nothing left); in the middle of epoch 1, in a run that crossed the epoch boundary
# after a resume. (These replace three random kill steps, each in a fresh run: 8, 4 and 2.)
KILLS = (3, 6, 9)


def _saved_step(ckpt):
    return torch.load(io.BytesIO(read_verified(ckpt)), weights_only=True)["step"]


def _resume_then_train_from_scratch(run_id, ckpt_path, log_path, full_ckpt_path, full_log_path):
    """The last resumed run, then the uninterrupted reference run in the same processes (it seeds itself)."""
    resumed = _resumable_training(run_id, ckpt_path, log_path, -1)
    return resumed, _resumable_training("full", full_ckpt_path, full_log_path, -1)


def test_kill_and_resume_is_bitwise_equal_and_serves_each_sample_once(tmp_path):
    ckpt, log, saved = str(tmp_path / "c.pt"), str(tmp_path / "log"), [0]
    for i, kill_at in enumerate(KILLS):
        with pytest.raises(minidp.WorkerFailed, match="SIGKILL"):
            run_ranks(_resumable_training, 2, f"run{i}", ckpt, log, kill_at, timeout=120, collective_timeout=30)
        saved.append(_saved_step(ckpt))
        assert saved[-1] == kill_at - 1  # the killed step's work is lost, nothing else
    full_ckpt, full_log = str(tmp_path / "full.pt"), str(tmp_path / "full")
    (resumed, full), _ = run_ranks(_resume_then_train_from_scratch, 2, f"run{len(KILLS)}", ckpt, log, full_ckpt,
                                   full_log, timeout=120, collective_timeout=30)
    assert all(torch.equal(a, b) for a, b in zip(resumed, full))
    saved.append(EPOCHS * SAMPLES // (2 * BATCH))  # the last run ends the training
    for rank in range(2):
        served, trained = _served(log, rank), {}
        for i in range(len(saved) - 1):
            steps = sorted(step for run, step in served if run == f"run{i}")
            assert steps[0] == saved[i] + 1, (rank, i, steps)  # each run went on from the last checkpoint
            trained.update({step: served[(f"run{i}", step)] for step in steps if step <= saved[i + 1]})
        expected = {step: v for (_, step), v in _served(full_log, rank).items()}
        assert trained == expected  # same samples, same order: none twice, none skipped
