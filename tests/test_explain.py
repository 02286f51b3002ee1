"""python -m minidp.explain: real ranks, real torch DDP as the reference for the bucket layout."""
import os

import pytest

from harness import workers_forked
from minidp.study.explain import explain, format_report, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_module_factory_find_unused_no_rebuild(tmp_path):
    # The function behind the command, from this process (tests/ is on sys.path, so models imports); its
    # rank forks from here where the harness finds that safe (a spawned one would import torch again).
    with workers_forked():
        report = explain("models:UnusedBranch", world_size=1, input_shape=(8,), find_unused=True, bucket_cap_mb=0.0001,
                         steps=2, out_dir=str(tmp_path), progress=lambda text: None)
    construction, last = report["phases"]
    assert not report["rebuilt"] and len(construction["buckets"]) > 1  # cap-sized buckets from the start
    assert construction["same_as_ddp"] and last["same_as_ddp"]
    assert "DDP does not rebuild either" in format_report(report)


def test_zero_overlap_shows_each_bucket_stepped_inside_backward(tmp_path):
    """--zero-overlap: rank 0 steps buckets 0, 2, ... (bucket i is rank i % 2's) before backward() returns;
    the trace has the ZeRO lanes (both ranks' broadcasts)."""
    with workers_forked():
        report = explain("models:MLP", world_size=2, input_shape=(8,), bucket_cap_mb=0.001, steps=3,
                         out_dir=str(tmp_path), progress=lambda text: None, zero_overlap="end")
    last = report["phases"][1]
    stepped = [b["index"] for b in last["buckets"] if b["zero_step_ms"] is not None]
    assert len(last["buckets"]) >= 2 and stepped == list(range(0, len(last["buckets"]), 2))
    assert all(last["backward_ms"] <= b["zero_step_ms"] <= last["returned_ms"] for b in last["buckets"]
               if b["zero_step_ms"] is not None)  # in the last bucket's hook, at the end of backward
    assert "ZeRO step" in format_report(report)
    trace = open(report["files"]["trace"]).read()
    assert '"ZeRO: broadcasts"' in trace and '"broadcast bucket 1 from rank 1"' in trace


@pytest.mark.parametrize("argv, message", [
    (["models:MLP", "--input-shape", "8", "--zero-overlap", "--steps", "2"], "needs 3 steps or more"),
    (["resnet1800"], "'resnet1800' is not a torchvision model. Did you mean resnet18"),
    (["resnet18", "--world-size", "0"], "--world-size=0 must be >= 1"),
    (["resnet18", "--input-shape", "3,a"], "--input-shape='3,a' must be positive integers"),
    (["resnet18", "--input-shape", "1,32,32", "--batch", "2"], "does not accept an input of shape (2, 1, 32, 32)"),
    (["models:nothing_here", "--input-shape", "8"], "module 'models' has no callable 'nothing_here'"),
    (["no_such_module:make", "--input-shape", "8"], "cannot import module 'no_such_module'"),
    (["models:MLP"], "give --input-shape"),
])
def test_clear_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_ranks_fork_only_where_each_runs_one_thread(monkeypatch):
    """One thread per rank: forked (no torch import again, no OpenMP pool to hang on); else launch() decides."""
    from minidp.study.explain import rank_start_method

    monkeypatch.delenv("MINIDP_START_METHOD", raising=False)
    assert rank_start_method(1) == "fork"
    assert rank_start_method(2) is None  # several threads: a fork could hang on this process's OpenMP pool
    monkeypatch.setenv("MINIDP_START_METHOD", "spawn")
    assert rank_start_method(1) is None  # the user's choice, applied by minidp.launch


def test_an_unwritable_out_is_one_line_before_any_rank(tmp_path):
    """The real command: `--out` under a file fails at once, one line, exit 2 (it failed after the ranks' run)."""
    import subprocess
    import sys
    (tmp_path / "a_file").write_text("")
    proc = subprocess.run([sys.executable, "-m", "minidp.explain", "resnet18", "--out", str(tmp_path / "a_file" / "x")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == [f"python -m minidp.explain: error: --out='{tmp_path}/a_file/x' cannot be "
                                        "written: Not a directory"], proc.stderr


def test_files_go_to_the_temp_dir_unless_told_where(capsys):
    """Without --out nothing is written into the current folder (often a checkout): the system's temp dir."""
    import inspect
    import tempfile

    from minidp.study import explain as module
    assert module.DEFAULT_OUT == os.path.join(tempfile.gettempdir(), "minidp-explain")
    assert inspect.signature(explain).parameters["out_dir"].default == module.DEFAULT_OUT
    with pytest.raises(SystemExit):
        main(["--help"])
    assert f"(default: {module.DEFAULT_OUT})" in " ".join(capsys.readouterr().out.split())
