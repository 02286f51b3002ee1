"""Smoke tests of benchmarks/speed/real_models.py --quick and its options: 2 forked ranks, tiny GPT-2.

No timing assertions (speed lives in benchmarks/RESULTS.md): the table's columns are there, every pair ran
both engines, and they took turns every step (the order flipped each step). The scripts run through their
main() in this process, their ranks forked from it (they always fork: rank_memory.launch_json), as
test_benchmarks.py runs compare_ddp.py: the same jobs and files without importing torch again.
"""
import gc
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks", folder) for folder in ("speed", "shared")]
import real_models  # noqa: E402
import real_models_ablate  # noqa: E402

import minidp.engine.layout as layout  # noqa: E402
import minidp.runtime.watchdog as watchdog  # noqa: E402
from minidp.engine.reducer import Reducer  # noqa: E402

PAIRS = ("ddp_static", "fsdp")  # a DDP pair and a sharded one (the suite's time: each pair is seconds)
OFF = ["watchdog", "small-batch", "hold-back", "early-write-back"]
REAL_WATCHDOG_START = watchdog.start
QUICK = ["--quick", "--world-sizes", "2", "--models", "gpt2", "--warmup", "1"]


def run(main, argv, tmp_path, capfd, name):
    """(what the command and its rank 0 printed, the JSON it wrote)."""
    path = tmp_path / f"{name}.json"
    assert main([*argv, "--json", str(path)]) == 0
    return capfd.readouterr().out, json.loads(path.read_text())


def test_real_models_quick(tmp_path, capfd):
    stdout, result = run(real_models.main, [*QUICK, "--pairs", *PAIRS, "--runs", "2", "--steps", "2"], tmp_path,
                         capfd, "quick")
    assert "ratio" in stdout and "held MiB" in stdout and "loadavg before" in stdout
    assert "ms t/m: forward" in stdout and "cpu ms by rank t/m:" in stdout
    assert [r["pair"] for r in result["rows"]] == list(PAIRS)
    for row in result["rows"]:
        assert set(result["columns"]) <= set(row), row
        assert row["model"] == "gpt2" and row["N"] == 2
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
        assert len(row["runs"]) == 2 and all(r["torch"] > 0 and r["minidp"] > 0 for r in row["runs"])
        # both engines every step, the first one flipped each step: t m, m t
        assert row["sequence"] == "tmmt", row["sequence"]
        assert row["colls_torch"] > 0 and row["colls_minidp"] > 0 and row["mb_minidp"] > 0
        assert row["held_minidp"] > 0 and row["held_pred"] > 0 and row["peak_pred"] > 0
        for side in ("torch", "minidp"):  # where the step's time goes: each phase measured
            phases = row["phases"][side]
            assert all(phases[p] > 0 for p in ("forward", "backward", "step", "cpu")), phases
            assert 0 <= phases["gc"] < phases["cpu"] + phases["forward"] + phases["backward"], phases
            # every rank's CPU a step, gathered to rank 0, whose own is the phases' figure
            assert len(row["cpu_by_rank"][side]) == 2 and all(c > 0 for c in row["cpu_by_rank"][side])
            assert row["cpu_by_rank"][side][0] == phases["cpu"]
    # the same collectives for the same options, whoever issues them
    assert all(r["colls_torch"] == r["colls_minidp"] for r in result["rows"])
    # each column ran its own engine
    assert all(r["engines"]["minidp"].startswith("minidp.") and r["engines"]["torch"].startswith("torch.")
               for r in result["rows"]), [r["engines"] for r in result["rows"]]


def test_the_collectors_time_is_counted():
    """The `gc` phase: gc.callbacks' hook adds each collection's wall time (a step's share is the
    difference of the total across it)."""
    before = real_models.IN_GC["total"]
    gc.callbacks.append(real_models.time_the_collector)
    gc.disable()  # no automatic collection may move the cycle below out of the youngest generation
    try:
        a, b = [], []
        a.append(b), b.append(a)  # a cycle: only the collector frees it
        del a, b
        assert gc.collect(0) > 0  # the youngest generation only: this process holds millions of objects
    finally:
        gc.enable()
        gc.callbacks.remove(real_models.time_the_collector)
    assert real_models.IN_GC["total"] > before


def test_real_models_ablated(tmp_path, capfd):
    """real_models_ablate.py hands what follows `--` to real_models.py with its note, and minidp's engine
    really runs with the switches off; --minidp-first: the build order; --split-backward: each backward's
    tail after its last gradient."""
    argv = ["--off", *OFF, "--", *QUICK, "--pairs", "ddp", "--runs", "1", "--steps", "2", "--minidp-first",
            "--split-backward"]
    stdout, result = run(real_models_ablate.main, argv, tmp_path, capfd, "ablated")
    assert "minidp built first" in stdout and "tail" in stdout
    assert "minidp ablated: watchdog small-batch hold-back early-write-back" in stdout
    assert result["config"]["note"] == "minidp ablated: watchdog small-batch hold-back early-write-back"
    assert result["config"]["build_order"] == ["minidp", "torch"]
    row, = result["rows"]
    assert row["engines"]["minidp"].startswith("minidp.") and row["sequence"] == "tmmt"
    assert row["colls_minidp"] == row["colls_torch"]  # the same collectives with the switches off
    for side in ("torch", "minidp"):
        phases = row["phases"][side]
        assert 0 < phases["tail"] < phases["backward"], phases
    assert _switchable_state() == (True, True, False, True)  # undone after the run


def test_real_models_control(tmp_path, capfd):
    """--control: torch's engine in both columns (the harness's own bias)."""
    argv = [*QUICK, "--pairs", "ddp", "--runs", "1", "--steps", "2", "--control"]
    stdout, result = run(real_models.main, argv, tmp_path, capfd, "control")
    assert "CONTROL" in stdout
    row, = result["rows"]
    torch_ddp = "torch.nn.parallel.distributed.DistributedDataParallel"
    assert row["engines"]["torch"].startswith(torch_ddp) and row["engines"]["minidp"].startswith(torch_ddp)
    assert row["sequence"] == "tmmt"


def _switchable_state():
    """(watchdog started?, small gradients batched?, a full last bucket launched before the end of
    backward?, buckets written back as they are reduced?), on stand-in reducers (the third: one full
    bucket, unpatched held back; the fourth: no status exchanged)."""
    import types

    from minidp.engine.step import Step
    bucket = types.SimpleNamespace(index=0, param_indices=[0], buffer=None)
    step = Step([bucket], 1, None)
    step.pending[0] = 0
    fake = types.SimpleNamespace(layout=types.SimpleNamespace(buckets=[bucket]), iteration=1, reduce=lambda b, buf: 0,
                                 recorder=types.SimpleNamespace(launch=lambda *a: None, watch=lambda *a: None))
    Reducer.launch_ready_buckets(fake, step)
    early = Reducer._writes_back_early(types.SimpleNamespace(_needs_status=lambda: False))
    return watchdog.start is REAL_WATCHDOG_START, layout.SMALL_GRAD_NUMEL > 0, len(step.futures) == 1, early


def test_ablate_switches_take_effect_and_are_undone():
    before = _switchable_state()
    assert before == (True, True, False, True)
    with real_models_ablate.switched_off(OFF):
        assert _switchable_state() == (False, False, True, False)
        assert watchdog.start(None, 0, 2) is None and watchdog.current() is None  # starts nothing
    assert _switchable_state() == before
    with pytest.raises(SystemExit):  # an unknown switch: argparse's one line
        real_models_ablate.main(["--off", "everything", "--", "--quick"])
