"""Failure behaviour: dead ranks, desync, uneven inputs (join). Real processes, gloo, CPU."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from models import build

# ---- dead ranks ---------------------------------------------------------------------------------

def _train_then_die(local_rank, how, pid_dir):
    torch.set_num_threads(1)
    minidp.init(timeout=20)  # the collective timeout: a peer that stays silent errors within 20 s
    with open(os.path.join(pid_dir, f"{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = minidp.DDP(build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if step == 5 and dist.get_rank() == 1:
            if how == "raise":
                raise ValueError("rank 1 fails at step 5 on purpose")
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_dead_rank_stops_everyone_quickly_five_times(tmp_path, how):
    elapsed = []
    for trial in range(5):
        pid_dir = tmp_path / f"{how}{trial}"
        pid_dir.mkdir()
        start = time.monotonic()
        with pytest.raises(minidp.WorkerFailed) as info:
            minidp.launch(_train_then_die, 2, args=(how, str(pid_dir)), timeout=60)
        elapsed.append(time.monotonic() - start)
        assert info.value.rank == 1, str(info.value)
        expected = "rank 1 fails at step 5" if how == "raise" else "killed by signal SIGKILL"
        assert expected in str(info.value)
        for rank in (0, 1):
            pid = int((pid_dir / f"{rank}.pid").read_text())
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    print(f"{how}: seconds from start to the launcher's error, per trial: {[round(e, 1) for e in elapsed]}")
    assert max(elapsed) < 30, elapsed


# ---- desync -------------------------------------------------------------------------------------

def _error_of(fn):
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _skip_backward():
    model = minidp.DDP(build("mlp"), debug=True)
    for step in range(4):
        loss = model(torch.randn(4, 8)).sum()
        if not (dist.get_rank() == 1 and step == 2):  # rank 1 forgets one backward
            loss.backward()


def _desync_worker():
    rank = dist.get_rank()
    return {
        "skip_backward": _error_of(_skip_backward),
        "bucket_cap": _error_of(lambda: minidp.DDP(build("mlp"), bucket_cap_mb=25 if rank == 0 else 5)),
    }


def test_desync_skipped_backward_and_different_bucket_cap_named_on_every_rank():
    results = run_ranks(_desync_worker, 2, timeout=120, collective_timeout=20)
    for rank, res in enumerate(results):
        skip = res["skip_backward"]
        assert skip is not None, f"rank {rank} saw no error"
        assert "ranks [1] differ from rank 0" in skip
        assert "rank 0: iteration 3, backward" in skip and "launching bucket 0" in skip
        assert "rank 1: iteration 4, forward" in skip
        cap = res["bucket_cap"]
        assert cap is not None and "before iteration 1" in cap and "ranks [1]" in cap
        assert "bucket_cap_mb=25" in cap and "bucket_cap_mb=5" in cap


def _one_step_fewer():
    model = minidp.DDP(build("mlp"), debug=True)
    steps = 6 if dist.get_rank() == 0 else 5  # rank 1 stops early, then shuts down
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()


def test_desync_one_step_fewer_names_rank_iteration_and_bucket():
    # Without debug mode, gloo may pair rank 0's extra all-reduce with rank 1's shutdown (it matches
    # collectives by order only): debug mode's fingerprint turns that into a clear error.
    start = time.monotonic()
    with pytest.raises(minidp.WorkerFailed) as info:
        run_ranks(_one_step_fewer, 2, timeout=120, collective_timeout=20)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert info.value.rank == 0
    assert "failed on rank 0 at iteration 6 (forward, before bucket 0 [" in message
    assert "ran a different number of steps" in message


# ---- join: uneven inputs ------------------------------------------------------------------------

JOIN_CASES = {
    "mlp": ("mlp", {}),
    "mlp_divide_by_live_ranks": ("mlp", {"divide_by_initial_world_size": False}),
    "cnn_batchnorm": ("cnn_bn", {}),
}


def _train_with_join(engine, model_name, join_kwargs, n_batches):
    torch.manual_seed(0)
    model = engine(build(model_name), bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    shape = (3, 4, 4) if model_name == "cnn_bn" else (8,)
    batches = [torch.randn(4, *shape, generator=gen) for _ in range(n_batches)]
    with model.join(**join_kwargs):
        for x in batches:
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]


def _join_worker(batches_per_rank):
    n = batches_per_rank[dist.get_rank()]
    out = {}
    for name, (model_name, kwargs) in JOIN_CASES.items():
        ours = _train_with_join(minidp.DDP, model_name, kwargs, n)
        theirs = _train_with_join(TorchDDP, model_name, kwargs, n)
        out[name] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    return out


@pytest.mark.parametrize("batches", [(5, 7), (5, 7, 6)], ids=["world2", "world3"])
def test_join_uneven_inputs_equals_torch_ddp_join(batches):
    results = run_ranks(_join_worker, len(batches), batches, timeout=200, collective_timeout=30)
    for rank, res in enumerate(results):
        for case, diff in res.items():
            assert diff == 0.0, f"rank {rank}, {case}: max abs difference from torch DDP's join {diff}"
