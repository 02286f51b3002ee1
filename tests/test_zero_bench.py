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
    # each launch says it started (and, past 30 s, that it still runs): on stderr, the table on stdout unchanged
    assert "... N=2 minidp_zero: 2 AdamW steps on 2 ranks, memory sampled" in out.stderr.splitlines(), out.stderr
    assert any(line.startswith("... step time: ") for line in out.stderr.splitlines()), out.stderr


def test_heartbeat_says_a_long_phase_is_still_running(capfd):
    """benchmarks/shared/heartbeat.py: a line when the phase starts, then one every `every_s`, none after it ends."""
    import time
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "shared"))
    from heartbeat import heartbeat
    with heartbeat("N=2 ddp: 3 steps", every_s=0.05):
        time.sleep(0.18)
    time.sleep(0.1)
    lines = capfd.readouterr().err.splitlines()
    assert lines[0] == "... N=2 ddp: 3 steps" and 2 <= len(lines) - 1 <= 4, lines
    assert all(line.startswith("... N=2 ddp: 3 steps: still running, ") for line in lines[1:]), lines
