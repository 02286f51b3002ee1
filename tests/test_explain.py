"""python -m minidp.explain: real ranks, real torch DDP as the reference for the bucket layout."""
import json
import os
import subprocess
import sys

import pytest

from harness import workers_forked
from minidp.study.explain import explain, format_report, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _explain(tmp_path, *argv):
    # The ranks fork (MINIDP_START_METHOD; the README's explain command, in test_readme.py, spawns them) from a
    # one-thread parent (a forked child cannot use an OpenMP pool its parent started).
    proc = subprocess.run([sys.executable, "-m", "minidp.explain", *argv, "--json", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "MINIDP_START_METHOD": "fork", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


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


@pytest.mark.parametrize("argv, message", [
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
