"""Smoke test of benchmarks/memory/fully_shard.py --quick: it runs all five configurations and the timing,
and what does not depend on timing holds: the counted DDP bytes are predict_memory's DDP row exactly
(plus AdamW's 4-byte `step`s), and
minidp's optimizer state equals torch FSDP2's rank by rank (reshard_after_forward True and False), and
its counted bytes at the peak are no more than FSDP2's (equal with the collectives' buffers)."""
import contextlib
import io
import json
import os
import subprocess
import sys

from harness import workers_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fsdp_timeline.py runs through its main() in this process, its ranks forked from it (as test_benchmarks.py runs
# timeline.py): the same job and files without importing torch again; the spawn path runs in test_readme.py
# and test_launch.py. The memory benchmark stays a command: it measures its processes' peaks from their start.
sys.path[:0] = [os.path.join(ROOT, "benchmarks", folder) for folder in ("overlap", "shared")]
import fsdp_timeline  # noqa: E402


def test_fully_shard_memory_benchmark_quick(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "memory", "fully_shard.py"), "--quick",
                          "--json", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    rows = {r["config"]: r for r in result["memory"]}
    assert set(rows) == {"ddp", "torch_fsdp", "minidp_fsdp", "torch_fsdp_keep", "minidp_fsdp_keep"}
    for peak, state in zip(rows["ddp"]["peaks"], rows["ddp"]["state"]):  # AdamW's `step`s: beside the row
        assert peak["total"] == rows["ddp"]["predicted_bytes"] + state["step"]
    for mine, theirs in (("minidp_fsdp", "torch_fsdp"), ("minidp_fsdp_keep", "torch_fsdp_keep")):
        assert rows[mine]["state"] == rows[theirs]["state"]
        assert rows[mine]["state"][0]["moments"] == rows["ddp"]["state"][0]["moments"] // 2
        # counted tensors at the sampled peak: no more than FSDP2's; with the collectives' buffers, the same
        for a, b in zip(rows[mine]["peaks"], rows[theirs]["peaks"]):
            assert a["total"] <= b["total"] and a["with_comm_max"] == b["with_comm_max"], (mine, a, b)
    assert "equal rank by rank: True" in out.stdout and "equal rank by rank: False" not in out.stdout
    assert set(result["step_ms"]) == set(rows)
    assert any(line.startswith("... step time: ") for line in out.stderr.splitlines()), out.stderr  # heartbeat.py


def test_fully_shard_timeline_quick(tmp_path):
    """benchmarks/overlap/fsdp_timeline.py --quick: a PNG, and a trace with both collectives' lanes on each rank."""
    with workers_forked(), contextlib.redirect_stdout(io.StringIO()):
        assert fsdp_timeline.main(["--quick", "--out", str(tmp_path)]) == 0
    stem = tmp_path / "results" / "fsdp_timeline_cpu"
    assert (stem.with_suffix(".png")).stat().st_size > 0
    trace = json.loads(stem.with_suffix(".json").read_text())
    trace = trace["traceEvents"] if isinstance(trace, dict) else trace
    lanes = {(e["pid"], e["args"]["name"]) for e in trace if e.get("name") == "thread_name"}
    for rank in (0, 1):
        assert {(rank, "fully_shard all-gather"), (rank, "fully_shard reduce-scatter")} <= lanes
    spans = [e for e in trace if e.get("ph") == "X" and e["pid"] == 0 and e["name"] in ("0", "2", "4", "6")]
    assert spans  # each Linear's unit (modules "0", "2", ...) has spans
