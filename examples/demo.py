"""`make demo`: the same short training under minidp and under torch DDP, then a comparison.

Trains examples/train_torchvision.py twice with 2 CPU worker processes (gloo), on the same
synthetic data with the same seed: a ResNet-18 with the CIFAR stem and base width 16 (0.7 M
parameters) on 1500 training images of 32x32 in 10 classes (shapes and colours plus noise),
4 epochs of 23 steps (2 workers x 32 images), SGD with momentum, lr 0.05 scaled to 0.1 by linear
warm-up over the first epoch, then cosine decay. Then it prints:
  * the validation accuracy of each run, on 500 held-out images, counted exactly over the ranks;
  * the largest absolute difference between the two runs' final weights and BatchNorm statistics
    (0.0 means bitwise equal);
  * the median step time of each run and their ratio minidp / DDP.
35 s to 1.5 min on the project's 2-core machine, with the load (README.md: the recorded runs).
Extra arguments go to both runs, e.g. `--epochs 5`.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import train_torchvision

from minidp.train.checkpoint import read_checkpoint

WARM = train_torchvision.WARM_STEPS + 1  # first step counted in the median (1-based)
ENGINES = ("minidp", "ddp")
SETTINGS = ["--nproc-per-node", "2", "--epochs", "4", "--batch-size", "32", "--width", "16",
            "--image-size", "32", "--train-per-class", "150", "--val-per-class", "50", "--seed", "0"]


def train_both(work: str, extra: list) -> dict:
    """Run the example once per engine; return each run's JSON report."""
    reports = {}
    for engine in ENGINES:
        print(f"--- training with {'torch DDP' if engine == 'ddp' else engine} ---", flush=True)
        report = os.path.join(work, f"{engine}.json")
        train_torchvision.main([*SETTINGS, *extra, "--engine", engine, "--report", report,
                                "--checkpoint", os.path.join(work, engine)])
        with open(report) as f:
            reports[engine] = json.load(f)
    return reports


def max_difference(path_a: str, path_b: str) -> tuple:
    """(largest |a - b| over the models' floating-point tensors, number of tensors) of two checkpoints."""
    a = read_checkpoint(path_a)["model"]  # verified (SHA-256) and loaded with weights_only=True
    b = read_checkpoint(path_b)["model"]
    tensors = [k for k, v in a.items() if v.is_floating_point()]
    return max(float((a[k] - b[k]).abs().max()) for k in tensors), len(tensors)


def print_report(reports: dict, wall_s: float) -> None:
    """The comparison table."""
    mine, ddp = reports["minidp"], reports["ddp"]
    diff, n = max_difference(mine["checkpoint"], ddp["checkpoint"])
    last = {e: reports[e]["history"][-1] for e in ENGINES}
    ms = {e: 1000 * reports[e]["median_step_s"] for e in ENGINES}
    print("\n=== minidp demo: ResNet-18 (width 16) on synthetic 32x32 images, 10 classes, 2 CPU workers ===")
    print(f"{'':28s}{'minidp':>12s}{'torch DDP':>12s}")
    print(f"{'validation accuracy':28s}{last['minidp']['val_accuracy']:>12.1%}{last['ddp']['val_accuracy']:>12.1%}"
          f"   ({last['minidp']['val_count']} images; chance 10%)")
    print(f"{'final training loss':28s}{last['minidp']['train_loss']:>12.4f}{last['ddp']['train_loss']:>12.4f}")
    print(f"{'median step time':28s}{ms['minidp']:>10.1f}ms{ms['ddp']:>10.1f}ms   ({mine['steps']} steps each)")
    verdict = "bitwise equal" if diff == 0 else "not bitwise equal"
    print(f"max |parameter difference| minidp vs DDP: {diff:.3g} ({verdict}; {n} weight and BatchNorm tensors)")
    print(f"step-time ratio minidp/DDP: {ms['minidp'] / ms['ddp']:.2f}   (median of steps {WARM}..{mine['steps']}; "
          "wall-clock, so other load on the machine moves it)")
    print(f"demo wall time: {wall_s:.0f} s")


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minidp-demo-") as work:
        reports = train_both(work, sys.argv[1:])
        print_report(reports, time.perf_counter() - start)


if __name__ == "__main__":
    main()
