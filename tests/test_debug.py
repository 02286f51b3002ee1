"""Debug mode (debug=True / MINIDP_DEBUG=1) under join(): joined ranks meet every check, nothing hangs.

Without a joined rank's side of the checks, a training rank's debug all-gather waited for the
collective timeout and then reported a false desync. Real processes, gloo, CPU; torch DDP's join is
the reference for the trained values, and a record of every check says who took part in which.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp.engine import debug as debug_mode
from models import build, input_shape

# name: (model, join() keywords, no_sync on every other step)
CASES_2 = {"mlp": ("mlp", {}, False), "cnn_bn_accumulate": ("cnn_bn", {}, True)}
CASES_3 = {"mlp": ("mlp", {}, False),
           "cnn_bn_live_ranks_accumulate": ("cnn_bn", {"divide_by_initial_world_size": False}, True)}


def _train(engine, model_name, join_kwargs, accumulate, n_batches):
    torch.manual_seed(0)
    extra = {"debug": True} if engine is minidp.DDP else {}
    model = engine(build(model_name), bucket_cap_mb=0.002, **extra)  # a few buckets once rebuilt
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = [torch.randn(4, *input_shape(model_name), generator=gen) for _ in range(n_batches)]
    with model.join(**join_kwargs):
        for step, x in enumerate(batches):
            local = accumulate and step % 2 == 0
            with model.no_sync() if local else contextlib.nullcontext():
                model(x).pow(2).mean().backward()
            if not local:
                opt.step()
                opt.zero_grad()
    return [t.detach().clone() for t in list(model.module.parameters()) + list(model.module.buffers())]


def _debug_join_worker(batches_per_rank, cases):
    checks = []  # (phase, iteration) of every debug check this rank took part in
    real_check = debug_mode.check

    def recording_check(phase, iteration, *args, **kwargs):
        checks.append((phase, iteration))
        return real_check(phase, iteration, *args, **kwargs)

    debug_mode.check = recording_check  # this worker process only
    n = batches_per_rank[dist.get_rank()]
    out = {"diff": {}, "checks": {}}
    for name, (model_name, join_kwargs, accumulate) in cases.items():
        checks.clear()
        ours = _train(minidp.DDP, model_name, join_kwargs, accumulate, n)
        theirs = _train(TorchDDP, model_name, join_kwargs, accumulate, n)
        out["diff"][name] = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
        out["checks"][name] = list(checks)
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


@pytest.mark.parametrize("batches, cases", [((5, 7), CASES_2), ((5, 7, 6), CASES_3)], ids=["2_ranks", "3_ranks"])
def test_debug_mode_under_join_equals_torch_ddp_and_joined_ranks_take_part(batches, cases):
    # A 20 s collective timeout: a rank left alone in a debug check fails the test quickly.
    results = run_ranks(_debug_join_worker, len(batches), batches, cases, timeout=200, collective_timeout=20)
    for rank, res in enumerate(results):
        for case, (_, _, accumulate) in cases.items():
            assert res["diff"][case] == 0.0, f"rank {rank}, {case}: max abs difference from torch DDP's join"
            assert res["checks"][case] == _expected_checks(batches[rank], max(batches), accumulate), (rank, case)


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
