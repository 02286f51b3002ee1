"""examples/train_lm.py: minidp and torch DDP end bitwise equal, the loss goes down, resume is exact.

One 2-rank launch trains the tiny transformer four times (both engines straight through, then
minidp stopped half-way with a checkpoint and resumed), with gradient accumulation and bf16
autocast on, on the text the example finds on the machine (torch's wheel ships license texts); the
straight minidp run also writes its --report and a --sample. The command line itself (its launcher,
its argument checks) runs in test_readme.py, as the README gives it.
"""
import json
import os
import sys

import torch

from harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--batch-size", "8",
        "--grad-accum", "2", "--bf16", "--lr", "3e-3", "--warmup-steps", "2", "--eval-batches", "2",
        "--log-every", "1000"]
STEPS = 16


def _four_runs(out_dir):
    import train_lm

    def run(*extra):
        return train_lm.train(train_lm.parse_args(TINY + ["--max-steps", str(STEPS), *extra]))

    report = os.path.join(out_dir, "report.json")
    ours, theirs = run("--engine", "minidp", "--report", report, "--sample", "20"), run("--engine", "ddp")
    half = ["--lr-decay-steps", str(STEPS), "--out-dir", out_dir]
    first = train_lm.train(train_lm.parse_args(TINY + ["--max-steps", str(STEPS // 2), *half]))
    resumed = train_lm.train(train_lm.parse_args(TINY + ["--max-steps", str(STEPS), *half, "--resume"]))
    return {"minidp": ours, "ddp": theirs, "first_half": first, "resumed": resumed}


def test_engines_bitwise_equal_loss_down_and_exact_resume(tmp_path):
    per_rank = run_ranks(_four_runs, 2, str(tmp_path), timeout=240)
    summary = json.loads((tmp_path / "report.json").read_text())  # rank 0's
    assert "license" in summary["data"].lower() and summary["losses"] == per_rank[0]["minidp"]["losses"]
    assert len(summary["weights_sha256"]) == 64
    for rank, res in enumerate(per_rank):
        ours, theirs = res["minidp"]["state"], res["ddp"]["state"]
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), f"rank {rank}: {name} differs between minidp and DDP"
        assert res["minidp"]["losses"] == res["ddp"]["losses"]
        resumed = res["resumed"]
        assert resumed["start"] == STEPS // 2 and len(resumed["losses"]) == STEPS // 2
        assert res["first_half"]["losses"] + resumed["losses"] == res["minidp"]["losses"]
        for name in ours:
            assert torch.equal(resumed["state"][name], ours[name]), f"resume is not exact for {name}"
    losses = per_rank[0]["minidp"]["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses  # from ~ln(vocab) down
    assert per_rank[0]["minidp"]["val_loss"] == per_rank[1]["minidp"]["val_loss"]  # counted over both ranks
