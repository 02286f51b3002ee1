"""examples/train_lm.py: minidp and torch DDP end bitwise equal, the loss goes down, resume is exact.

One 2-rank launch trains the tiny transformer four times (both engines straight through, then
minidp stopped half-way with a checkpoint and resumed), with gradient accumulation and bf16
autocast on; the command line itself runs once, on the text it finds on the machine.
"""
import json
import os
import subprocess
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

    ours, theirs = run("--engine", "minidp"), run("--engine", "ddp")
    half = ["--lr-decay-steps", str(STEPS), "--out-dir", out_dir]
    first = train_lm.train(train_lm.parse_args(TINY + ["--max-steps", str(STEPS // 2), *half]))
    resumed = train_lm.train(train_lm.parse_args(TINY + ["--max-steps", str(STEPS), *half, "--resume"]))
    return {"minidp": ours, "ddp": theirs, "first_half": first, "resumed": resumed}


def test_engines_bitwise_equal_loss_down_and_exact_resume(tmp_path):
    per_rank = run_ranks(_four_runs, 2, str(tmp_path), timeout=240)
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


def test_command_line_on_the_text_found_on_the_machine(tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), "--tiny",
                           "--nproc-per-node", "2", "--sample", "20", "--report", str(report)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(report.read_text())
    assert "license" in summary["data"].lower() and len(summary["losses"]) == 3
    assert "minidp: " in proc.stdout and "characters from" in proc.stdout and "val loss" in proc.stdout
