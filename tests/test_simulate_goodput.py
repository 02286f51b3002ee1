"""python -m minidp.simulate goodput: the formulas by hand, the Monte-Carlo against them and against the exact
renewal formula, Young/Daly, heal against restart at Llama 3's rate, --measured, bad input, and the command."""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from minidp.study.goodput import (
    LLAMA3_FAILURES_PER_GPU_HOUR,
    Costs,
    checkpoint_interval_s,
    goodput_heal,
    goodput_restart,
    job_mtbf_s,
    monte_carlo,
    simulate_heal,
    simulate_restart,
    young_daly_interval_s,
)
from minidp.study.goodput_table import goodput_rows, main

# one failure an hour; every cost a round number, so that each goodput is a fraction worked out by hand
HAND = Costs(step_s=10, detect_s=30, restart_s=270, checkpoint_write_s=60, heal_s=50, peer_wait_s=160, quorum_s=2.5)


def test_formulas_by_hand_at_one_failure_an_hour():
    mtbf_s = job_mtbf_s(16, 1 / 16)  # 16 GPUs, each failing once in 16 hours: the job once an hour
    assert mtbf_s == 3600
    # (a) a checkpoint every 660 s, written in 60: each failure costs 30 + 270 + 660 / 2 = 630 s of every GPU,
    # and 60 s of each 660 go to writing: (600 / 660) x (1 - 630 / 3600) = (10 / 11) x 0.825 = 0.75
    assert goodput_restart(HAND, mtbf_s, checkpoint_every_s=660) == pytest.approx(0.75, abs=1e-12)
    # (b) 2 replicas of 8: each failure costs 30 + 10 + 160 + (270 + 50) / 2 = 360 s of the job, 10 % of an hour;
    # a step of 10 s pays 2.5 s of quorum: (10 / 12.5) x (1 - 360 / 3600) = 0.8 x 0.9 = 0.72
    assert goodput_heal(HAND, mtbf_s, replicas=2) == pytest.approx(0.72, abs=1e-12)


def test_young_daly_interval_and_llama3_rate():
    assert LLAMA3_FAILURES_PER_GPU_HOUR == 419 / (54 * 24 * 16384)
    mtbf_s = job_mtbf_s(16384, LLAMA3_FAILURES_PER_GPU_HOUR)
    assert mtbf_s / 3600 == pytest.approx(54 * 24 / 419)  # a failure every 3.09 hours, as Llama 3 saw
    assert young_daly_interval_s(30, mtbf_s) == pytest.approx(math.sqrt(2 * 30 * mtbf_s))
    costs = Costs()
    best = checkpoint_interval_s(costs, mtbf_s)  # None: Young/Daly's
    assert best == young_daly_interval_s(costs.checkpoint_write_s, mtbf_s)
    at = goodput_restart(costs, mtbf_s)
    assert at > goodput_restart(costs, mtbf_s, best / 2) and at > goodput_restart(costs, mtbf_s, best * 2)


def test_restart_played_out_on_a_schedule_by_hand():
    costs = Costs(detect_s=20, restart_s=30, checkpoint_write_s=10)  # down 50 s a failure, checkpoints every 100
    # failure at 250: 2 intervals saved (2 x 90 s), 50 s lost, back at 300; 7 more intervals to 1,000 -> 810 s
    assert simulate_restart([(250.0, 0)], 1000.0, costs, 100.0) == pytest.approx(0.81)
    # another at 280, while restarting: back at 330; 6 intervals, then 70 s not yet saved at the end -> 790 s
    assert simulate_restart([(250.0, 0), (280.0, 5)], 1000.0, costs, 100.0) == pytest.approx(0.79)


def test_heal_played_out_on_a_schedule_by_hand():
    costs = Costs(step_s=10, detect_s=30, restart_s=100, heal_s=20, peer_wait_s=5, quorum_s=0)
    # 2 groups of 8; GPU 3 (group 0) fails at 100: the job stalls to 140, trains at half speed to 260 while group 0
    # restarts and heals, stalls 5 s for its first step, then trains whole: 100 + 60 + 735 = 895 s of 1,000
    assert simulate_heal([(100.0, 3)], 1000.0, costs, 8, 2) == pytest.approx(0.895)
    # group 0 fails again at 200, out of the quorum: nobody waits, its restart begins again (out to 350)
    assert simulate_heal([(100.0, 3), (200.0, 7)], 1000.0, costs, 8, 2) == pytest.approx((100 + 105 + 645) / 1000)


def test_monte_carlo_agrees_with_the_formulas_within_its_tolerance():
    rows = goodput_rows([1024, 16384], seed=0)
    for row in rows:
        for way in ("restart", "heal"):
            assert abs(row[f"{way}_mc"] - row[way]) <= row[f"{way}_tolerance"], (way, row)
            assert 0 < row[f"{way}_mc_se"] < 1e-3, row
    # and with the exact expected goodput of (a) under the Monte-Carlo's own rules (a renewal argument: from a
    # checkpoint, an interval P completes in (exp(P / M) - 1) M exp(down / M) of wall time on average)
    costs = Costs()
    for row in rows:
        mtbf_s, interval = row["mtbf_h"] * 3600, row["checkpoint_every_s"]
        down = costs.detect_s + costs.restart_s
        exact = (interval - costs.checkpoint_write_s) / (math.expm1(interval / mtbf_s) * mtbf_s
                                                         * math.exp(down / mtbf_s))
        assert abs(row["restart_mc"] - exact) <= 4 * row["restart_mc_se"], (row, exact)


def test_heal_beats_restart_at_16384_gpus_at_llama3_rate():
    mtbf_s = job_mtbf_s(16384, LLAMA3_FAILURES_PER_GPU_HOUR)
    costs = Costs()
    assert goodput_heal(costs, mtbf_s, 16384 // 8) > goodput_restart(costs, mtbf_s) + 0.05
    mc = monte_carlo(16384, LLAMA3_FAILURES_PER_GPU_HOUR, costs, runs=4, failures_per_run=200)
    assert mc["heal"][0] > mc["restart"][0] + 0.05


def test_measured_costs_fill_in_and_json_is_written_only_when_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    measured = tmp_path / "ft_goodput.json"
    measured.write_text(json.dumps({"detect_s": 2.5, "restart_s": 40, "heal_s": None, "device": "cpu"}))
    out = tmp_path / "table.json"
    argv = ["--gpus", "1024", "--measured", str(measured), "--restart-s", "90", "--mc-runs", "2",
            "--mc-failures", "50"]
    assert main(argv) == 0
    assert os.listdir(tmp_path) == ["ft_goodput.json"]  # no --json: nothing written
    assert main(argv + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"^  --detect-s +2\.5 +measured: {re.escape(str(measured))}$", text, re.M), text
    assert re.search(r"^  --restart-s +90 +given$", text, re.M), text  # a flag wins over the file
    assert re.search(r"^  --heal-s +20 +default, assumed", text, re.M), text  # null: the default
    assert "--measured's keys not used: device" in text
    table = json.loads(out.read_text())
    assert table["assumptions"]["costs"]["detect_s"] == 2.5 and [r["gpus"] for r in table["rows"]] == [1024]


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "0"], "--gpus=0 must be >= 1"),
    (["--gpus", "1020"], "--gpus=1020 is not a multiple of --gpus-per-replica=8"),
    (["--gpus", "8"], "--gpus=8 makes 1 replica"),
    (["--gpus", "1024,x"], "--gpus='1024,x'"),
    (["--failures-per-gpu-hour=-1e-5"], "--failures-per-gpu-hour=-1e-05 must be > 0"),
    (["--failures-per-gpu-hour", "0"], "--failures-per-gpu-hour=0.0 must be > 0"),
    (["--gpus-per-replica", "0"], "--gpus-per-replica=0 must be >= 1"),
    (["--step-s", "0"], "--step-s=0.0 must be > 0"),
    (["--restart-s", "-5"], "--restart-s=-5.0 must be >= 0"),
    (["--heal-s", "nan"], "--heal-s=nan must not be NaN"),
    (["--quorum-s", "inf"], "--quorum-s=inf must be finite"),
    (["--checkpoint-every-s", "20"], "--checkpoint-every-s=20.0 must be > --checkpoint-write-s=30.0"),
    (["--checkpoint-write-s", "0"], "--checkpoint-write-s=0 makes Young/Daly's interval 0"),
    (["--measured", "/no/such/ft_goodput.json"], "--measured='/no/such/ft_goodput.json'"),
    (["--mc-runs", "1"], "--mc-runs=1 must be >= 2"),
])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(argv, words, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the input was checked")
    monkeypatch.setattr("minidp.study.goodput_table.goodput_rows", no_work)
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_the_command_prints_the_assumptions_and_the_table(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minidp.simulate", "goodput", "--gpus", "1024,16384"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for flag in ("--gpus", "--failures-per-gpu-hour", "--gpus-per-replica", "--step-s", "--detect-s", "--restart-s",
                 "--checkpoint-write-s", "--heal-s", "--peer-wait-s", "--quorum-s", "--checkpoint-every-s"):
        assert f"\n  {flag} " in out, flag
    assert "419 unexpected interruptions in 54 days on 16,384 H100s" in out and "Young/Daly" in out
    rows = {int(line.split()[0].replace(",", "")): line.split() for line in out.splitlines()
            if line.strip().startswith(("1,024 ", "16,384 ")) and len(line.split()) == 10}
    assert sorted(rows) == [1024, 16384], out
    assert rows[16384][4] == f"{math.sqrt(2 * 30 * 3600 * 54 * 24 / 419):,.0f}"  # the interval used, Young/Daly's
    assert float(rows[16384][9]) > 1.05 and float(rows[16384][7]) > float(rows[16384][5])  # heal beats restart
    assert "Monte-Carlo check" in out and os.listdir(tmp_path) == []  # nothing written without --json
