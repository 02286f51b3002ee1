"""Smoke test of benchmarks/memory/zero.py --quick: it runs, and prints its table and the step-time ratio."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_zero_memory_benchmark_quick():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "memory", "zero.py"), "--quick"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    for config in ("ddp", "torch_zero", "minidp_zero"):
        assert f" 2 {config}" in out.stdout
    assert "equal to torch ZeRO's rank by rank: True" in out.stdout
    assert "ratio" in out.stdout
