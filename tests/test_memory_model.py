"""minidp.simulate --memory: the ZeRO paper's Figure 1 as printed, the formulas by hand, communication, bad input.

No torch in this file: the model and its command line are pure arithmetic.
"""
import json
import os
import subprocess
import sys

import pytest

from minidp.study.memory_model import predict_memory, predict_peak
from minidp.study.memory_table import parse_count
from minidp.study.simulate import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(text: str) -> dict:
    """{name: [weights, gradients, optimizer, total, sent, volume]} as printed, from the table's rows."""
    names = ("DDP (", "ZeRO-1 (", "ZeRO-2 (", "ZeRO-3 (")  # not the note below the table
    rows = [line.split() for line in text.splitlines() if line.startswith(names)]
    return {row[0]: row[2:] for row in rows}


def test_figure_1_as_the_real_command_prints_it(tmp_path):
    # The real command, with a `torch` that cannot be imported first on the path: --memory needs no torch.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('python -m minidp.simulate imported torch')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    proc = subprocess.run([sys.executable, "-m", "minidp.simulate", "--memory"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Ψ = 7.5e9 parameters, K = 12, N = 64 ranks; per rank, in GB (10^9 bytes)" in proc.stdout
    table = _table(proc.stdout)
    # Figure 1 of Rajbhandari et al. (SC 2020): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    assert [table[name][3] for name in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == ["120", "31.4", "16.6", "1.9"]
    assert table["DDP"][:3] == ["15", "15", "90"]  # 2Ψ, 2Ψ, KΨ
    # 2Ψ elements of 2 bytes, of which a ring sends 63/64; ZeRO-3 3Ψ
    assert [table[name][4:] for name in table] == [["29.5", "2Ψ"]] * 3 + [["44.3", "3Ψ"]]
    assert "ZeRO-2/3 (fully_shard) benchmarks/memory/fully_shard.py" in proc.stdout


def test_the_formulas_by_hand():
    # Ψ = 1,000, N = 4, K = 12: every share divides exactly.
    rows = predict_memory(1000, ranks=4, k=12)
    got = [(r["name"], r["weights"], r["gradients"], r["optimizer"], r["total"]) for r in rows]
    assert got == [("DDP", 2000, 2000, 12000, 16000),   # (2 + 2 + K)Ψ
                   ("ZeRO-1", 2000, 2000, 3000, 7000),  # 2Ψ + 2Ψ + KΨ/N
                   ("ZeRO-2", 2000, 500, 3000, 5500),   # 2Ψ + (2 + K)Ψ/N
                   ("ZeRO-3", 500, 500, 3000, 4000)]    # (2 + 2 + K)Ψ/N
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    # sent: each collective of Ψ elements sends (N-1)/N Ψ from a rank; DDP 2 of them, 2 bytes an element
    assert [r["sent"] for r in rows] == [3000, 3000, 3000, 4500]
    # fp32 weights (4 bytes), bf16 gradients (2): the all-gathers move weights, the reductions gradients
    mixed = predict_memory(1000, ranks=4, k=8, weight_bytes=4, grad_bytes=2)
    assert [r["sent"] for r in mixed] == [750 * (2 + 2), 750 * (2 + 4), 750 * (2 + 4), 750 * (4 + 4 + 2)]
    assert [r["total"] for r in mixed] == [14000, 8000, 6500, 3500]
    one = predict_memory(1000, ranks=1)  # one rank: nothing to shard, nothing to send
    assert {r["total"] for r in one} == {16000} and {r["sent"] for r in one} == {0}


@pytest.mark.parametrize("ranks", [2, 8, 64, 1024])
def test_communication_ratios(ranks):
    ddp, zero1, zero2, zero3 = predict_memory(7.5e9, ranks)
    assert zero1["sent"] == zero2["sent"] == ddp["sent"] > 0  # reduce-scatter + all-gather = all-reduce
    assert zero3["sent"] == pytest.approx(1.5 * ddp["sent"])  # one more all-gather, in backward
    assert [r["volume"] for r in (ddp, zero1, zero2, zero3)] == [2, 2, 2, 3]


def test_other_points_and_json(capsys):
    for text in ("7.5e9", "7.5B", "7.5b", "7500000000", "7.5G", "7500M"):
        assert parse_count(text) == 7_500_000_000, text
    assert main(["--memory", "--params", "1.3B", "--ranks", "8", "--k", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["params"], out["ranks"], out["k"]) == (1_300_000_000, 8, 16)
    assert out["rows"] == predict_memory(1.3e9, 8, 16)
    assert out["rows"][3]["total"] == pytest.approx(20 * 1.3e9 / 8)
    assert main(["--memory", "--params", "125M", "--ranks", "1"]) == 0
    table = _table(capsys.readouterr().out)
    assert [table[name][3] for name in table] == ["2"] * 4  # 16 bytes x 125 M on one rank, all stages alike


@pytest.mark.parametrize("argv, message", [
    (["--memory", "--params", "7.5X"], "--params='7.5X' is not a count"),
    (["--memory", "--params", "0"], "--params='0' must be a count of at least 1"),
    (["--memory", "--params=-7.5B"], "--params='-7.5B' must be a count of at least 1"),
    (["--memory", "--ranks", "0"], "--ranks=0 must be >= 1"),
    (["--memory", "--k", "-1"], "--k=-1.0 must be >= 0"),
    (["--events", "e.json", "--ranks", "8"], "--ranks only apply with --memory"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


def test_bad_arguments_to_the_function():
    with pytest.raises(ValueError, match="params=0 must be > 0"):
        predict_memory(0, 4)
    with pytest.raises(ValueError, match="ranks=0 must be >= 1"):
        predict_memory(1000, 0)
    with pytest.raises(TypeError, match="ranks=2.5 must be an int"):
        predict_memory(1000, 2.5)


# predict_peak: Ψ = 400 in four units of U = 100 (one tensor each), N = 4, w = g = 2, K = 12:
# the stage's shards are (2 + 2 + 12) * 400 / 4 = 1600 bytes, every share exact.
FOUR = [[100]] * 4


def test_peak_zero3_by_hand():
    p = predict_peak(FOUR, 4, "ZeRO-3")
    # unit 1's backward: its gathered weights 2 * 100, its full gradients 2 * 100, unit 0's prefetched
    # all-gather output 2 * 100, unit 2's reduce-scatter input 2 * 100; units 2 and 3's sharded gradients
    assert p["where"] == "backward, unit 1 of 0..3: its gradients complete"
    assert (p["weights"], p["optimizer"], p["gradients"]) == (200, 1200, 2 * 200 / 4)
    assert (p["gathered"], p["unsharded_grads"], p["buffers"]) == (200, 200, 200 + 200)
    assert p["total"] == 1600 - 2 * 2 * 100 / 4 + 2 * 2 * 100 + 2 * 2 * 100 == 2300
    # without the buffers: unit 0's backward, one sharded gradient short (its own)
    assert p["without_buffers"] == 1600 - 2 * 100 / 4 + 2 * 100 + 2 * 100 == 1950
    assert (p["params"], p["shard_ranks"]) == (400, 4)


def test_peak_zero2_by_hand():
    p = predict_peak(FOUR, 4, "ZeRO-2")
    # unit 2's backward: units 0..2 still gathered (2 * 300), unit 3's input (2 * 100) and sharded gradient
    assert p["where"] == "backward, unit 2 of 0..3: its gradients complete"
    assert (p["gathered"], p["unsharded_grads"], p["buffers"], p["gradients"]) == (600, 200, 200, 50)
    assert p["total"] == (2 + 12) * 400 / 4 + 2 * 300 + 2 * 100 / 4 + 2 * 2 * 100 == 2450
    # without the buffers: the start of backward, every unit gathered, the last unit's gradients
    assert p["without_buffers"] == (2 + 12) * 400 / 4 + 2 * 400 + 2 * 100 == 2400


def test_peak_hsdp_shards_over_the_shard_group():
    # a (replicate 2, shard 2) mesh of 4 ranks holds what fully_shard on 2 ranks holds
    for stage in ("ZeRO-2", "ZeRO-3"):
        hsdp, two = predict_peak(FOUR, 4, stage, replicate=2), predict_peak(FOUR, 2, stage)
        assert hsdp["shard_ranks"] == 2 and {k: v for k, v in hsdp.items() if k != "shard_ranks"} == \
            {k: v for k, v in two.items() if k != "shard_ranks"}
    assert predict_peak(FOUR, 2, "ZeRO-3")["total"] == 3200 - 2 * 2 * 100 / 2 + 4 * 2 * 100 == 3800


def test_peak_zero1_and_ddp_by_hand():
    # tensors 300, 200, 100 on 2 ranks: 300 to rank 0, 200 to rank 1, 100 to rank 1 (the fewer): 300 most
    units = [[300, 100], [200]]
    p = predict_peak(units, 2, "ZeRO-1")
    assert (p["weights"], p["gradients"], p["optimizer"], p["buffers"]) == (1200, 1200, 12 * 300, 0)
    assert p["total"] == p["without_buffers"] == 6000
    assert predict_peak(units, 2, "ZeRO-1", bucket_views=False)["buffers"] == 1200  # DDP's buckets
    assert predict_peak(units, 2, "DDP")["total"] == 16 * 600 == predict_memory(600, 2)[0]["total"]
    # 6 x Linear(2048, 2048) on 4 ranks, fp32 AdamW: the weights 0, 1, 2, 3, 0, 1; the fullest rank two
    linear = [[2048 * 2048, 2048]] * 6
    assert predict_peak(linear, 4, "ZeRO-1", k=8)["optimizer"] == 8 * 2 * 2048 * 2048


def test_peak_equals_the_stage_plus_the_working_set():
    # Linear(2048, 2048) units in fp32, AdamW: ZeRO-3's row + 2 w U + 2 g U - 2 g U / N, every N
    linear = [[2048 * 2048, 2048]] * 6
    u = 2048 * 2048 + 2048
    for n in (2, 4, 8):
        row = predict_memory(6 * u, n, k=8, weight_bytes=4, grad_bytes=4)[3]["total"]
        assert predict_peak(linear, n, "ZeRO-3", k=8, weight_bytes=4, grad_bytes=4)["total"] == \
            pytest.approx(row + 16 * u - 8 * u / n)


def test_peak_copy_in_moment():
    # fp32 gradients of bf16 weights, a small last unit: unit 1's copy-in (its full gradients beside its
    # reduce-scatter input) holds more than its compute (its weights beside unit 2's small input)
    p = predict_peak([[10], [100], [1]], 4, "ZeRO-3", k=0, weight_bytes=2, grad_bytes=4)
    assert p["where"] == "backward, unit 1's reduce-scatter copy-in"
    # shards, unit 2's sharded gradient, unit 1's full gradients, unit 0's prefetch, unit 1's input
    assert p["total"] == 2 * 111 / 4 + 4 * 1 / 4 + 4 * 100 + 2 * 10 + 4 * 100 == 876.5
    assert p["gathered"] == 0


def test_peak_bad_arguments():
    with pytest.raises(ValueError, match="stage='ZeRO-4' must be one of"):
        predict_peak(FOUR, 4, "ZeRO-4")
    with pytest.raises(ValueError, match="replicate=3 must divide ranks=4"):
        predict_peak(FOUR, 4, "ZeRO-3", replicate=3)
    with pytest.raises(ValueError, match="HSDP is fully_shard's"):
        predict_peak(FOUR, 4, "ZeRO-1", replicate=2)
    with pytest.raises(ValueError, match="units=\\[\\] must be"):
        predict_peak([], 4, "ZeRO-3")
    with pytest.raises(TypeError, match="must be an int"):
        predict_peak([[1.5]], 4, "ZeRO-3")
