"""The compression study and the GPU check as commands: tiny runs of the real scripts, and their argument checks.

benchmarks/gpu_check.py is written for a GPU; here it runs its CPU dry run (gloo, the CuPy rows
reported as skipped), which goes through the same checks except the CUDA device, CupyNccl and the
host-sync count (set_sync_debug_mode needs CUDA).
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import compression  # noqa: E402 - benchmarks/ is not a package
import gpu_check  # noqa: E402

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def _run(*cmd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_compression_study_quick_run_writes_json_plot_and_table(tmp_path):
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# notes kept\n")
    proc = _run("benchmarks/compression.py", "--quick", "--configs", "exact,TopK 1%+EF,local SGD /4", "--out",
                str(tmp_path), "--results-md", str(results_md), "--synthetic-dir", str(tmp_path / "data"))
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "results" / "compression_cpu.json") as f:
        data = json.load(f)
    rows = {r["name"]: r for r in data["results"]}
    assert list(rows) == ["exact", "TopK 1%+EF", "local SGD /4"] and data["world_size"] == 2
    assert rows["TopK 1%+EF"]["bytes_measured"] == rows["TopK 1%+EF"]["bytes_analytical"] < rows["exact"]["bytes_dense"]
    assert os.path.getsize(tmp_path / "results" / "compression_cpu.png") > 1000
    assert rows["exact"]["step_ratio"] == 1.0 and rows["TopK 1%+EF"]["step_ratio"] > 0
    text = results_md.read_text()
    assert text.startswith("# notes kept\n") and "<!-- BEGIN compression cpu -->" in text and "| TopK 1%+EF |" in text


def _table_rows(stdout: str) -> list[dict]:
    header = ("| check ", "| ---")
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith(header)]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    return [dict(zip(("check", "world", "collectives", "result", "detail"), c)) for c in cells]


def test_gpu_check_dry_run_on_cpu_runs_every_check_and_counts_collectives(tmp_path):
    """The issue 22 criteria: a collectives column, every passing row communicated, 3+ rows at world size 2,
    SyncBatchNorm beside a compression hook passes; one verdict line per check."""
    results_md = tmp_path / "RESULTS.md"
    proc = _run("benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--steps", "1", "--results-md",
                str(results_md), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| check | world | collectives | result | detail |" in proc.stdout
    verdicts = [line for line in proc.stdout.splitlines() if line.startswith("check ")]
    assert [v.split(":")[0] for v in verdicts] == [f"check {name}" for name in gpu_check.CHECKS], verdicts
    rows = _table_rows(proc.stdout)
    passed = [r for r in rows if r["result"] == "ok"]
    assert all(int(r["collectives"]) >= 1 for r in passed), passed
    assert {r["result"] for r in rows} == {"ok", "skipped"}  # skipped: CupyNccl without CUDA
    assert sum(r["world"] == "2" for r in passed) >= 3
    assert any(r["check"].startswith("SyncBatchNorm + compression_hook") for r in passed)
    assert sum("+EF on cpu tensors over gloo" in r["check"] for r in passed) == len(gpu_check.COMPRESSORS)
    assert "<!-- BEGIN gpu_check cpu -->" in results_md.read_text()


@pytest.mark.gpu
def test_gpu_check_quick_on_cuda_passes():
    """The script itself on the GPU (issue 22): every check, quick; CupyNccl may be skipped without CuPy."""
    proc = _run("benchmarks/gpu_check.py", "--quick", "--steps", "2", "--results-md", "", timeout=480)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table_rows(proc.stdout)
    assert all(int(r["collectives"]) >= 1 for r in rows if r["result"] == "ok"), rows
    assert any(r["check"].startswith("default step, status on the host") and r["result"] == "ok" for r in rows)


def test_gpu_check_fails_a_row_that_issued_no_collective():
    rows = gpu_check.judged([gpu_check.row("silent", True, "looked fine"), gpu_check.row("talked", True, "x", 3),
                             gpu_check.row("skipped", None, "no CuPy")], world=2)
    assert [(r["result"], r["world"]) for r in rows] == [("FAIL", 2), ("ok", 2), ("skipped", 2)]
    assert rows[0]["detail"].startswith("issued no collective")


@pytest.mark.parametrize("module, argv, words", [
    (compression, ["--configs", "exact,Zip"], "--configs: unknown ['Zip']"),
    (compression, ["--epochs", "0"], "argument --epochs"),
    (gpu_check, ["--device", "cpu", "--steps", "0"], "--steps 0 must be >= 1"),
    (gpu_check, ["--device", "cpu", "--checks", "engine,zip"], "choose from engine,status,cupy,compressors,world2"),
])
def test_benchmark_arguments_are_checked(module, argv, words, capsys):
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert words in capsys.readouterr().err


def test_gpu_check_refuses_cuda_without_a_gpu(capsys):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit):
        gpu_check.parse_args([])
    assert "use --device cpu for a dry run" in capsys.readouterr().err


def test_runs_in_parts_merge_into_one_table(tmp_path):
    def result(name, accuracy, step):
        return {"name": name, "times": [step] * 5, "val_accuracy": accuracy, "val_loss": 1.0, "train_loss": 1.0,
                "bytes_measured": 10, "bytes_analytical": 10, "bytes_dense": 100}
    parts = [{"args": {"width": 16, "epochs": 4}, "world_size": 2, "device": "cpu",
              "results": [result("exact", 0.5, 1.0), result("Sign+EF", 0.4, 3.0)]},
             {"args": {"width": 16, "epochs": 4}, "world_size": 2, "device": "cpu",
              "results": [result("exact", 0.6, 2.0), result("FP16", 0.45, 3.0)]}]
    for i, part in enumerate(parts):
        compression.add_step_ratios(part)
        (tmp_path / f"{i}.json").write_text(json.dumps(part))
    merged = compression.merge([str(tmp_path / "0.json"), str(tmp_path / "1.json")])
    assert [r["name"] for r in merged["results"]] == ["exact", "FP16", "Sign+EF"]  # the study's order
    assert merged["results"][0]["val_accuracy"] == 0.5  # the first run's exact
    assert [r["step_ratio"] for r in merged["results"]] == [1.0, 1.5, 3.0]  # each against its own run's exact
    assert "| FP16 | 0.450 | 1.000 | 1.000 | 10 | 10 | 0.1000 | 1.50 |" in compression.table(merged)
