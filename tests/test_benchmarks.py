"""Smoke tests of the benchmark scripts (--quick, into a tmp dir) and of the timeline exporters.

No timing assertions: only that the outputs exist and hold sane numbers (speed lives in
benchmarks/RESULTS.md). compare_ddp.py --quick and timeline.py --quick run through their main() in this
process, with their workers forked from it (tests/harness.py): the same jobs and files, without paying
seconds of CPU per process for importing torch and torch._dynamo again on this 2-core machine. (The
benchmark scripts that run as real commands are in test_comm_bench.py: gpu/gpu_check.py and compression/study.py.)
"""
import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from harness import workers_forked
from minidp.engine.timeline import Timeline, bucket_spans, trace_events, write_chrome_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/ is not a package: the scripts' folders go on the path, as each script puts its own there.
sys.path[:0] = [os.path.join(ROOT, "benchmarks", folder) for folder in ("speed", "overlap", "gpu", "shared")]
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
import compare_ddp  # noqa: E402
import timeline  # noqa: E402
from plot_timeline import plot_timelines  # noqa: E402 - benchmarks/overlap/ holds the drawing
from processes import clean_env  # noqa: E402

WORKLOADS = ("mlp", "resnet18", "deep300")
# The benchmark scripts' minidp.launch forks its workers (no second import of torch in each): what is tested
# here is what they measure and write; the spawn path runs in test_readme.py and test_launch.py.
FORKED = clean_env(MINIDP_START_METHOD="fork")
PNG_MAGIC = b"\x89PNG"


def _run_script(name, *args, timeout=240):
    """Run benchmarks/<name> (e.g. "speed/compare_ddp.py") with this interpreter; fail with its output if it fails."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", name), *args], cwd=ROOT, env=FORKED,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _compare_main(*argv):
    """compare_ddp.main(argv) in this process, workers forked; returns what it printed."""
    out = io.StringIO()
    with workers_forked(), contextlib.redirect_stdout(out):
        assert compare_ddp.main(list(argv)) == 0
    return out.getvalue()


def _is_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ---- compare_ddp.py --quick ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_compare(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    stdout = _compare_main("--quick", "--out", str(out))
    with open(out / "results" / "compare_ddp_cpu.json") as f:
        return out, json.load(f), stdout


def test_compare_every_workload_at_every_world_size(quick_compare):
    _, data, _ = quick_compare
    seen = {(r["job"]["workload"], r["world_size"]) for r in data["timing"]
            if r["job"]["bucket_cap_mb"] is None and not r["job"]["gbv"]}
    assert seen == {(w, n) for w in WORKLOADS for n in (1, 2)}
    assert any(r["job"]["gbv"] for r in data["timing"])
    assert any(r["job"]["bucket_cap_mb"] is not None for r in data["timing"])


def test_compare_numbers_are_sane(quick_compare):
    _, data, _ = quick_compare
    for r in data["timing"]:
        for engine in ("minidp", "ddp"):
            stats = r["phases"][engine]
            assert _is_positive(stats["median"]) and stats["p25"] <= stats["median"] <= stats["p75"]
            assert _is_positive(r["construction"][engine]["median"])
            assert _is_positive(r["derived"]["samples_per_s"][engine])
        assert _is_positive(r["derived"]["ratio"]) and _is_positive(r["derived"]["construction_ratio"])
        if r["derived"]["limits"]:
            for lim in r["derived"]["limits"].values():
                assert _is_positive(lim["compute"]) and _is_positive(lim["allreduce"])
                assert lim["serial"] == pytest.approx(lim["compute"] + lim["allreduce"])
                assert 0.0 <= lim["hidden"] <= 1.0
    (auto,) = data["autotune"]  # quick: the first workload only
    assert auto["chosen"] in (1, 5, 25, 100) and auto["job"]["bucket_cap_mb"] == "auto"
    assert {"minidp", "ddp", "cap=1", "cap=100"} <= set(auto["phases"])
    assert all(_is_positive(st["median"]) for st in auto["phases"].values())
    assert data["memory"], "no memory figures"
    for m in data["memory"]:
        assert _is_positive(m["peak_mib"]) and m["peak_mib"] >= m["baseline_mib"] > 0


def test_compare_writes_markdown_and_plot(quick_compare):
    out, data, stdout = quick_compare
    text = (out / "RESULTS.md").read_text()
    assert "<!-- BEGIN compare_ddp cpu -->" in text and "<!-- END compare_ddp cpu -->" in text
    assert torch.__version__ in text and "--quick" in text and "minidp/DDP" in text
    for workload in WORKLOADS:
        assert f"| {workload} | 1 |" in text and f"| {workload} | 2 |" in text
    png = out / "results" / "step_times_cpu.png"
    assert png.read_bytes()[:4] == PNG_MAGIC and png.stat().st_size < 200_000
    assert "comm hidden" in stdout  # the limits table is printed too
    assert 'bucket_cap_mb="auto" against every fixed cap' in text and "| auto / best |" in text


def test_compare_rewrites_report_from_json(quick_compare, tmp_path):
    out, data, _ = quick_compare
    _compare_main("--from-json", str(out / "results" / "compare_ddp_cpu.json"), "--out", str(tmp_path))
    text = (tmp_path / "RESULTS.md").read_text()
    assert data["meta"]["command"] in text and "| deep300 | 2 |" in text


# ---- hook_cost.py --quick --------------------------------------------------------------------------

def test_hook_cost_quick(tmp_path):
    import hook_cost
    path = tmp_path / "hook_cost.json"
    with workers_forked(), contextlib.redirect_stdout(io.StringIO()) as out:
        assert hook_cost.main(["--quick", "--world-sizes", "1", "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())
    assert result["world_size"] == 1 and result["grads"] == 62  # quick deep300: 30 blocks + head, 2 each
    assert set(result["per_grad_us"]) == {"minidp", "ddp"} and all(map(_is_positive, result["backward_ms"].values()))
    assert any("(grad_ready)" in row["function"] for row in result["profile"])  # the hook ran, profiled
    assert "per-gradient cost over plain" in out.getvalue()


# ---- timeline.py --quick ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quick_timeline(tmp_path_factory):
    """timeline.main() of `python benchmarks/overlap/timeline.py --quick ...`; the stem of the files it writes."""
    out = tmp_path_factory.mktemp("timeline")
    with workers_forked(), contextlib.redirect_stdout(io.StringIO()):
        assert timeline.main(["--quick", "--out", str(out), "--bucket-cap-mb", "0.01", "--steps", "3"]) == 0
    return out / "results" / "timeline_mlp_cpu"


def test_timeline_event_order(quick_timeline):
    with open(f"{quick_timeline}_events.json") as f:
        data = json.load(f)
    assert set(data["events"]) == {"0", "1"} and len(data["plan"]) > 1
    for events in data["events"].values():
        spans = bucket_spans(events)
        assert sorted(s["bucket"] for s in spans) == list(range(len(data["plan"])))
        for s, names in zip(sorted(spans, key=lambda s: s["bucket"]), data["plan"]):
            assert s["params"] == len(names)
            assert s["last_ready"] <= s["launch"] <= s["done"], s  # launched after its last gradient
        kinds = [k for k, _, _ in sorted(events, key=lambda e: e[1])]
        assert kinds.index("forward_start") < kinds.index("backward_start") < kinds.index("backward_end")
        assert kinds.index("backward_end") < kinds.index("finalize_end") < kinds.index("step_end")


def test_timeline_trace_and_png(quick_timeline):
    with open(f"{quick_timeline}.json") as f:
        trace = json.load(f)["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    assert any(e["name"].startswith("all-reduce bucket") for e in spans)
    assert {"forward", "backward", "optimizer"} <= {e["name"] for e in spans}
    png = f"{quick_timeline}.png"
    assert open(png, "rb").read(4) == PNG_MAGIC and os.path.getsize(png) < 200_000


# ---- minidp.timeline exporters on made-up events (no processes) --------------------------------

def _fake_events():
    ms = 1_000_000
    return [("forward_start", 0, {}), ("backward_start", 2 * ms, {}),
            ("grad_ready", 3 * ms, {"param": "b.weight", "bucket": 0}), ("launch", 3 * ms + 10, {"bucket": 0}),
            ("grad_ready", 4 * ms, {"param": "a.weight", "bucket": 1}), ("launch", 4 * ms + 10, {"bucket": 1}),
            ("backward_end", 5 * ms, {}), ("done", 6 * ms, {"bucket": 0}), ("done", 7 * ms, {"bucket": 1}),
            ("finalize_end", 7 * ms + 5, {}), ("step_end", 8 * ms, {})]


def test_bucket_spans_pair_ready_launch_done():
    spans = bucket_spans(_fake_events())
    assert [(s["bucket"], s["params"], s["last_ready"], s["launch"], s["done"]) for s in spans] == [
        (0, 1, 3_000_000, 3_000_010, 6_000_000), (1, 1, 4_000_000, 4_000_010, 7_000_000)]


def test_trace_events_units_and_lanes(tmp_path):
    events = trace_events(_fake_events(), pid=3)
    backward = next(e for e in events if e.get("name") == "backward")
    assert (backward["ts"], backward["dur"], backward["pid"]) == (2000.0, 3000.0, 3)  # microseconds
    bucket1 = next(e for e in events if e.get("name") == "all-reduce bucket 1")
    assert bucket1["ts"] == pytest.approx(4000.01) and bucket1["dur"] == pytest.approx(2999.99)
    timeline = Timeline(_fake_events())
    timeline.to_chrome_trace(str(tmp_path / "t.json"))
    plot_timelines(str(tmp_path / "t.png"), {0: timeline.snapshot()})
    write_chrome_trace(str(tmp_path / "two.json"), {0: _fake_events(), 1: _fake_events()})
    plot_timelines(str(tmp_path / "two.png"), {0: _fake_events(), 1: _fake_events()}, "two ranks")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (tmp_path / "t.png").read_bytes()[:4] == PNG_MAGIC
    assert (tmp_path / "two.png").read_bytes()[:4] == PNG_MAGIC


def test_results_section_replaced_in_place(tmp_path):
    import report

    path = str(tmp_path / "RESULTS.md")
    report.write_section(path, "cpu", "first table")
    with open(path, "a") as f:
        f.write("\nA note written by hand.\n")
    report.write_section(path, "cuda", "gpu table")
    report.write_section(path, "cpu", "second table")
    text = open(path).read()
    assert "second table" in text and "first table" not in text
    assert "A note written by hand." in text and "gpu table" in text



def test_gpu_check_shared_launch_reruns_alone_what_a_crash_left_unchecked(monkeypatch):
    """On the CPU the checks of one world size share a launch; a check that crashes it must still get
    its own FAIL row, and the checks after it their own runs (each alone), not be lost with it."""
    import gpu_check

    launches = []

    def fake_launch(worker, procs, args, timeout):
        names, _, folder = args
        launches.append(list(names))
        for name in names:
            if name == "crashes":
                raise RuntimeError("worker rank 0 failed: boom")
            with open(os.path.join(folder, f"{name}.json"), "w") as f:
                json.dump({"rows": [gpu_check.row(name, True, "fine", 1)], "seconds": 0.5}, f)

    monkeypatch.setattr(gpu_check.minidp, "launch", fake_launch)
    monkeypatch.setitem(gpu_check.CHECKS, "crashes", (None, 1))
    args = gpu_check.parse_args(["--device", "cpu", "--results-md", ""])
    found = gpu_check.run_checks(["engine", "crashes", "status"], args)
    assert launches == [["engine", "crashes", "status"], ["crashes"], ["status"]]
    assert [r["result"] for r in found["engine"][0]] == ["ok"] and [r["result"] for r in found["status"][0]] == ["ok"]
    (failed,), _ = found["crashes"]
    assert failed["result"] == "FAIL" and "boom" in failed["detail"], failed
    assert args.share_processes  # the CPU dry run shares launches by default


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_compare_quick_on_cuda(tmp_path):
    _run_script("speed/compare_ddp.py", "--quick", "--device", "cuda", "--world-sizes", "1", "--no-memory",
                "--out", str(tmp_path))
    with open(tmp_path / "results" / "compare_ddp_cuda.json") as f:
        data = json.load(f)
    assert {r["job"]["workload"] for r in data["timing"]} == set(WORKLOADS)
    assert all(r["device"].startswith("cuda") for r in data["timing"])


# ---- simulator/simulate_check.py and speed/step_cost.py: what a run leaves behind, what it prints ----------

def test_simulate_check_writes_outside_the_tree_unless_asked(tmp_path, capsys):
    """A rerun writes into --out (default runs/simulator/, which git ignores), never over benchmarks/results/'s
    recorded files (only --record does); an unwritable --out is one line, before any rank starts."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "simulator"))
    import simulate_check
    recorded = os.path.join(ROOT, "benchmarks", "results", "simulate_resnet18_cluster.png")
    before = os.stat(recorded).st_mtime_ns
    assert simulate_check.DEFAULT_OUT == os.path.join(ROOT, "runs", "simulator")
    assert simulate_check.main(["--from-json", os.path.join(ROOT, "benchmarks", "results", "simulate_check.json"),
                                "--out", str(tmp_path)]) == 0
    assert (tmp_path / "simulate_resnet18_cluster.png").read_bytes()[:4] == PNG_MAGIC
    assert os.stat(recorded).st_mtime_ns == before
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        simulate_check.main(["--out", str(tmp_path / "a_file" / "x")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("cannot be written: Not a directory")


def test_step_cost_keeps_the_profilers_log_lines_out():
    """torch 2.14's Kineto prints 'USDT: ... profiler_start' and 'gpuGetDeviceCount failed' lines around the results
    at every profiled step; step_cost.py sets KINETO_LOG_LEVEL=6 before torch is imported (the ranks inherit it).
    Checked by reading the script: a real run costs seconds of this suite (it was checked by hand, 2026-12-06)."""
    source = open(os.path.join(ROOT, "benchmarks", "speed", "step_cost.py")).read()
    assert 'os.environ.setdefault("KINETO_LOG_LEVEL", "6")' in source
    assert source.index('os.environ.setdefault("KINETO_LOG_LEVEL"') < source.index("\nimport torch")
