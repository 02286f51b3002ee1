"""Failure behaviour: dead ranks, desync, uneven inputs (join). Real processes, gloo, CPU."""
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import assert_dead, error_of, run_ranks, write_pid
from models import build, input_shape

# ---- dead ranks ---------------------------------------------------------------------------------
# One trial: rank 1 is SIGKILLed mid-training, so it leaves no traceback and rank 0 is blocked in the
# engine's all-reduce. (A rank that raises is tested once, in test_launch.py.)

def _train_then_die(local_rank, pid_dir):
    torch.set_num_threads(1)
    minidp.init(timeout=20)  # the collective timeout: a peer that stays silent errors within 20 s
    write_pid(pid_dir, dist.get_rank())
    model = minidp.DDP(build("mlp"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if step == 5 and dist.get_rank() == 1:
            with open(os.path.join(pid_dir, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_rank_killed_mid_training_stops_everyone_quickly(tmp_path):
    with pytest.raises(minidp.WorkerFailed) as info:
        minidp.launch(_train_then_die, 2, args=(str(tmp_path),), timeout=120)
    after_kill = time.time() - float((tmp_path / "killed_at").read_text())
    assert info.value.rank == 1 and "killed by signal SIGKILL" in str(info.value), str(info.value)
    assert_dead(str(tmp_path), 2)
    # Well under the 20 s collective timeout: the launcher saw the death, it did not wait for rank 0 to time out.
    assert after_kill < 15, f"{after_kill:.1f} s from the kill to the launcher's error"


# ---- one 2-rank run for join and the desyncs that leave the group usable ------------------------

@pytest.fixture(scope="module")
def two_ranks():
    # Join first, while the group is clean; each desync case then ends in an error on every rank
    # at the same collective, so the group stays usable for the next case.
    return run_ranks(_two_rank_worker, 2, timeout=200, collective_timeout=30)


def _two_rank_worker():
    return {"join": _join_worker((5, 7)), "throw": _throw_worker((3, 5)), **_desync_worker()}


# ---- desync -------------------------------------------------------------------------------------

def _skip_backward():
    model = minidp.DDP(build("mlp"), debug=True)
    for step in range(4):
        loss = model(torch.randn(4, 8)).sum()
        if not (dist.get_rank() == 1 and step == 2):  # rank 1 forgets one backward
            loss.backward()


def _desync_worker():
    rank = dist.get_rank()
    return {
        "skip_backward": error_of(_skip_backward),
        "bucket_cap": error_of(lambda: minidp.DDP(build("mlp"), bucket_cap_mb=25 if rank == 0 else 5)),
    }


def test_desync_skipped_backward_and_different_bucket_cap_named_on_every_rank(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert res["skip_backward"] is not None, f"rank {rank} saw no error"
        kind, skip = res["skip_backward"]
        assert kind == "RuntimeError", res
        assert "ranks [1] differ from rank 0" in skip
        assert "rank 0: iteration 3, backward" in skip and "launching bucket 0" in skip
        assert "rank 1: iteration 4, forward" in skip
        assert res["bucket_cap"] is not None, f"rank {rank} saw no error"
        kind, cap = res["bucket_cap"]
        assert kind == "RuntimeError" and "before iteration 1" in cap and "ranks [1]" in cap
        assert "bucket_cap_mb=25" in cap and "bucket_cap_mb=5" in cap


def _one_step_fewer():
    model = minidp.DDP(build("mlp"), debug=True)
    steps = 6 if dist.get_rank() == 0 else 5  # rank 1 stops early, then shuts down
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()


def test_desync_one_step_fewer_names_rank_iteration_and_bucket():
    # Without debug mode, gloo may pair rank 0's extra all-reduce with rank 1's shutdown (it matches
    # collectives by order only): debug mode's fingerprint turns that into a clear error.
    with pytest.raises(minidp.WorkerFailed) as info:  # the message below is debug mode's, not a timeout's
        run_ranks(_one_step_fewer, 2, timeout=120, collective_timeout=20)
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
    batches = [torch.randn(4, *input_shape(model_name), generator=gen) for _ in range(n_batches)]
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


def _assert_join_equal(results):
    for rank, res in enumerate(results):
        assert set(res) == set(JOIN_CASES)
        for case, diff in res.items():
            assert diff == 0.0, f"rank {rank}, {case}: max abs difference from torch DDP's join {diff}"


def test_join_uneven_inputs_equals_torch_ddp_join_two_ranks(two_ranks):
    _assert_join_equal([res["join"] for res in two_ranks])


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


def test_join_uneven_inputs_equals_torch_ddp_join_three_ranks():
    _assert_join_equal(run_ranks(_join_worker, 3, (5, 7, 6), timeout=200, collective_timeout=30))
