"""bucket_cap_mb="auto": the cap is one of the candidates, every rank adopts rank 0's, and training
equals torch DDP run with that cap.

One 3-rank launch: at 3 ranks the tuned layout (gradients per bucket, in launch order) must be torch
DDP's with the chosen cap, since there gloo's summation order depends on the layout; and on a 2-rank
subgroup of it, whole training runs (tuning steps included) are bitwise equal to torch DDP's with the
chosen cap (at 2 ranks a sum does not depend on the layout, so the tuning steps' other layouts do not
change a bit). Timing decides the choice, so the tests assert properties of it, never which cap wins.
"""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import minidp
from harness import run_ranks
from minidp.engine import layout as autocap  # AutoCap and its constants live with the layout
from models import build
from training import bitwise_equal, offset_by_rank, rank_batches, snapshot, train

CANDIDATES = (0.0005, 0.002, 0.01, 1)  # MiB: 3 distinct layouts of the test MLP (0.01 and 1: one bucket)
STEPS = autocap.ROUNDS * 3 * (autocap.STEPS + 1) + 4  # every visit of the 3 layouts, and a few after


def _train(engine, cap, group, steps=STEPS):
    rank = dist.get_rank(group)
    model = offset_by_rank(build("mlp"), rank)
    wrapped = engine(model, bucket_cap_mb=cap, process_group=group)
    train(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9), rank_batches(steps, rank))
    return wrapped, snapshot(model)


def _torch_layout(cap):
    """torch DDP's buckets (parameter names) in its third iteration, seen by a recording hook."""
    model = build("mlp")
    names = {id(p): n for n, p in model.named_parameters()}
    wrapped, seen = TorchDDP(model, bucket_cap_mb=cap), []

    def recording_hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        return default_hooks.allreduce_hook(state, bucket)
    wrapped.register_comm_hook(None, recording_hook)
    for _ in range(3):
        seen.clear()
        wrapped(torch.randn(4, 8)).sum().backward()
    return seen


def _worker():
    autocap.CANDIDATE_CAPS_MB = CANDIDATES  # read when a tuner is built
    ours, _ = _train(minidp.DDP, "auto", None)
    tuner = ours.auto_bucket_cap
    out = {"chosen": tuner.chosen, "timed": sorted(tuner.medians()), "fastest_here": tuner.fastest(),
           "layout": ours.bucket_plan(), "torch_layout": _torch_layout(tuner.chosen)}
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 0 and 1 train on it
    if dist.get_rank() < 2:
        auto, auto_params = _train(minidp.DDP, "auto", pair)
        _, theirs = _train(TorchDDP, auto.auto_bucket_cap.chosen, pair)
        out["pair"] = {"chosen": auto.auto_bucket_cap.chosen,
                       "bitwise": bitwise_equal(auto_params, theirs)}
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 3, timeout=240)


def test_choice_is_a_candidate_timed_and_agreed_by_every_rank(results):
    chosen = {r["chosen"] for r in results}
    assert len(chosen) == 1 and chosen <= set(CANDIDATES)
    assert results[0]["timed"] == [0.0005, 0.002, 0.01]  # 1 MiB lays out what 0.01 does: not timed again
    assert CANDIDATES[results[0]["fastest_here"]] == results[0]["chosen"]  # rank 0's fastest


def test_tuned_layout_is_torch_ddps_with_the_chosen_cap(results):
    for r in results:
        assert r["layout"] == r["torch_layout"]
        assert len(r["layout"]) > 1 or r["chosen"] >= 0.01


def test_training_with_auto_is_bitwise_torch_ddp_with_the_chosen_cap(results):
    pair = [r["pair"] for r in results[:2]]
    assert pair[0]["chosen"] == pair[1]["chosen"]
    assert all(p["bitwise"] for p in pair)
