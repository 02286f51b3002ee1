"""Debug mode (debug=True / MINIDP_DEBUG=1): desync diagnosis, and joined ranks that meet every check.

Ranks that disagree about what they reduce (one skips a backward, runs a step fewer, builds other
buckets) get an error that names the ranks, iterations and buckets, on every rank, instead of a hang.
Under join() (test_join.py) a rank whose data has run out still meets every check: without its side,
a training rank's debug all-gather waited for the collective timeout and then reported a false desync.
Real processes, gloo, CPU; torch DDP's join is the reference for the trained values, and a record of
every check says who took part in which.
"""
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import error_of, run_ranks
from minidp.engine import collectives as debug_mode  # debug mode's per-step check
from models import build, input_shape
from training import max_abs_diff, mean_square, rank_batches, snapshot, train

# name: (model, join() keywords, no_sync on every other step)
CASES_2 = {"mlp": ("mlp", {}, False), "cnn_bn_accumulate": ("cnn_bn", {}, True)}
CASES_3 = {"mlp": ("mlp", {}, False),
           "cnn_bn_live_ranks_accumulate": ("cnn_bn", {"divide_by_initial_world_size": False}, True)}


def _train(engine, model_name, join_kwargs, accumulate, n_batches):
    """Parameters and buffers after n_batches under join(); with `accumulate`, a step every second batch."""
    torch.manual_seed(0)
    extra = {"debug": True} if engine is minidp.DDP else {}
    model = engine(build(model_name), bucket_cap_mb=0.002, **extra)  # a few buckets once rebuilt
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = rank_batches(n_batches, dist.get_rank(), inputs=(4, *input_shape(model_name)), targets=None)
    with model.join(**join_kwargs):
        train(model, opt, batches, mean_square, accumulate=2 if accumulate else 1)
    return snapshot(model.module, buffers=True)


def _debug_join_worker(batches_per_rank, cases):
    checks = []  # (phase, iteration) of every debug check this rank took part in
    real_check = debug_mode.check

    def recording_check(phase, iteration, *args, **kwargs):
        checks.append((phase, iteration))
        return real_check(phase, iteration, *args, **kwargs)

    debug_mode.check = recording_check  # this worker process only, until the cases are done
    n = batches_per_rank[dist.get_rank()]
    out = {"diff": {}, "checks": {}}
    try:
        for name, (model_name, join_kwargs, accumulate) in cases.items():
            checks.clear()
            ours = _train(minidp.DDP, model_name, join_kwargs, accumulate, n)
            theirs = _train(TorchDDP, model_name, join_kwargs, accumulate, n)
            out["diff"][name] = max_abs_diff(ours, theirs)
            out["checks"][name] = list(checks)
    finally:
        debug_mode.check = real_check
    return out


def _expected_checks(n_mine, n_most, accumulate):
    """The checks a rank takes part in: a forward check on every forward under join(), a backward check
    on every synced step; its own iterations first, then the joined ones it shadows."""
    checks, iteration = [], 0
    for step in range(n_most):
        joined, synced = step >= n_mine, not (accumulate and step % 2 == 0)
        checks.append((debug_mode.FORWARD, debug_mode.JOINED if joined else iteration + 1))
        if synced:
            iteration += 1
            checks.append((debug_mode.BACKWARD, debug_mode.JOINED if joined else iteration))
    return checks


# ---- one launch per world size: under join() first, while the group is clean; each desync case then
# ends in an error on every rank at the same collective, so the group stays usable for the next --------

# run id: (fixture, batches per rank, cases)
RUNS = {"2_ranks": ("two_ranks", (5, 7), CASES_2), "3_ranks": ("three_ranks", (5, 7, 6), CASES_3)}


@pytest.fixture(scope="module")
def two_ranks():
    # A 20 s collective timeout: a rank left alone in a debug check fails the test quickly.
    return run_ranks(_two_rank_worker, 2, timeout=200, collective_timeout=20)


@pytest.fixture(scope="module")
def three_ranks():
    _, batches, cases = RUNS["3_ranks"]
    return run_ranks(_three_rank_worker, 3, batches, cases, timeout=200, collective_timeout=20)


def _two_rank_worker():
    _, batches, cases = RUNS["2_ranks"]
    return {"join": _debug_join_worker(batches, cases), **_desync_worker()}


def _three_rank_worker(batches, cases):
    return {"join": _debug_join_worker(batches, cases)}


@pytest.mark.parametrize("run", list(RUNS))
def test_debug_mode_under_join_equals_torch_ddp_and_joined_ranks_take_part(run, request):
    fixture, batches, cases = RUNS[run]
    results = [res["join"] for res in request.getfixturevalue(fixture)]
    for rank, res in enumerate(results):
        for case, (_, _, accumulate) in cases.items():
            assert res["diff"][case] == 0.0, f"rank {rank}, {case}: max abs difference from torch DDP's join"
            assert res["checks"][case] == _expected_checks(batches[rank], max(batches), accumulate), (rank, case)


# ---- desync ---------------------------------------------------------------------------------------

def _skip_backward(debug=True):
    model = minidp.DDP(build("mlp"), debug=debug)
    for step in range(4):
        loss = model(torch.randn(4, 8)).sum()
        if not (dist.get_rank() == 1 and step == 2):  # rank 1 forgets one backward
            loss.backward()


def _skip_backward_with_env():
    """The same desync, with debug mode turned on by MINIDP_DEBUG=1 instead of debug=True."""
    os.environ["MINIDP_DEBUG"] = "1"  # this worker process only
    try:
        return _skip_backward(debug=None)  # None, the default: the environment decides
    finally:
        del os.environ["MINIDP_DEBUG"]


def _desync_worker():
    rank = dist.get_rank()
    return {
        "skip_backward": error_of(_skip_backward),
        "skip_backward_env": error_of(_skip_backward_with_env),
        "bucket_cap": error_of(lambda: minidp.DDP(build("mlp"), bucket_cap_mb=25 if rank == 0 else 5)),
    }


def _assert_skipped_backward_named(res, rank, case):
    assert res[case] is not None, f"rank {rank} saw no error ({case})"
    kind, skip = res[case]
    assert kind == "RuntimeError", res
    assert "ranks [1] differ from rank 0" in skip
    assert "rank 0: iteration 3, backward" in skip and "launching bucket 0" in skip
    assert "rank 1: iteration 4, forward" in skip


def test_desync_skipped_backward_and_different_bucket_cap_named_on_every_rank(two_ranks):
    for rank, res in enumerate(two_ranks):
        _assert_skipped_backward_named(res, rank, "skip_backward")
        assert res["bucket_cap"] is not None, f"rank {rank} saw no error"
        kind, cap = res["bucket_cap"]
        assert kind == "RuntimeError" and "before iteration 1" in cap and "ranks [1]" in cap
        assert "bucket_cap_mb=25" in cap and "bucket_cap_mb=5" in cap


def test_minidp_debug_environment_variable_turns_debug_mode_on(two_ranks):
    for rank, res in enumerate(two_ranks):
        _assert_skipped_backward_named(res, rank, "skip_backward_env")


def _one_step_fewer():
    model = minidp.DDP(build("mlp"), debug=True)
    steps = 6 if dist.get_rank() == 0 else 5  # rank 1 stops early, then shuts down
    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()


def test_desync_one_step_fewer_names_rank_iteration_and_bucket():
    # A launch of its own: the run must fail. Without debug mode, gloo may pair rank 0's extra
    # all-reduce with rank 1's shutdown (it matches collectives by order only): debug mode's
    # fingerprint turns that into a clear error.
    with pytest.raises(minidp.WorkerFailed) as info:  # the message below is debug mode's, not a timeout's
        run_ranks(_one_step_fewer, 2, timeout=120, collective_timeout=20)
    message = str(info.value)
    assert info.value.rank == 0
    assert "failed on rank 0 at iteration 6 (forward, before bucket 0 [" in message
    assert "ran a different number of steps" in message


# ---- the comparison itself (no processes) -------------------------------------------------------

F, B, J = debug_mode.FORWARD, debug_mode.BACKWARD, debug_mode.JOINED


@pytest.mark.parametrize("rows, reference, differing", [
    ([[F, 6, 7, -1, 3], [F, J, 7, -1, 3]], 0, []),  # a joined rank has no iteration of its own
    ([[B, J, 7, 0, 3], [B, 6, 7, 0, 3], [B, 6, 7, 0, 3]], 1, []),  # rank 0 joined: rank 1 is the reference
    ([[F, J, 7, -1, 3], [B, 6, 7, 0, 3]], 1, [0]),  # joined, but shadowing the wrong phase
    ([[B, 6, 7, 0, 3], [B, J, 9, 0, 4]], 0, [1]),  # joined with other buckets
    ([[B, 6, 7, 0, 3], [F, 7, 7, -1, 3], [B, J, 7, 0, 3]], 0, [1]),  # a training rank a step ahead
])
def test_joined_fingerprint_is_compared_without_its_iteration(rows, reference, differing):
    assert debug_mode.find_differing(rows) == (reference, differing)


def test_report_names_joined_ranks():
    text = debug_mode._describe([F, J, 0x1234, -1, 3], None)
    assert text == "joined (no more data), forward, bucket plan 0x1234 (3 buckets)"
