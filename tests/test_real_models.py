"""Smoke tests of benchmarks/speed/real_models.py --quick and its options: real commands, 2 forked ranks, tiny GPT-2.

No timing assertions (speed lives in benchmarks/RESULTS.md): the table's columns are there, every pair ran
both engines, and they took turns every step (the order flipped each step). The three commands start
together (each is seconds of importing torch on one core; the suite's time).
"""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from processes import clean_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEED = os.path.join(ROOT, "benchmarks", "speed")
PAIRS = ("ddp_static", "fsdp")  # a DDP pair and a sharded one (the suite's time: each pair is seconds)
OFF = ("watchdog", "small-batch", "hold-back")
QUICK = ["--quick", "--world-sizes", "2", "--models", "gpt2", "--warmup", "1"]

# The ablation switches, checked in one process: first unpatched, then after the switches. After them the
# watchdog starts nothing, no gradient counts as small, and a full last bucket launches before the end of
# backward (a stand-in reducer with one full bucket: held back unpatched).
CHECK_SWITCHES = """
import sys, types
sys.argv = ["x"]
sys.path.insert(0, {here!r})
import real_models_ablate as ablate
import minidp.engine.layout as layout, minidp.runtime.watchdog as watchdog
from minidp.engine.reducer import Reducer
from minidp.engine.step import Step

def state():
    bucket = types.SimpleNamespace(index=0, param_indices=[0], buffer=None)
    step = Step([bucket], 1, None)
    step.pending[0] = 0
    fake = types.SimpleNamespace(layout=types.SimpleNamespace(buckets=[bucket]), iteration=1,
                                 recorder=types.SimpleNamespace(launch=lambda *a: None, watch=lambda *a: None),
                                 reduce=lambda b, buf: "future")
    Reducer.launch_ready_buckets(fake, step)
    try:
        started = watchdog.start(None, 0, 2) is None and watchdog.current() is None
    except Exception:  # the real watchdog needs a store
        started = "raised"
    print(started, layout.SMALL_GRAD_NUMEL > 0, len(step.futures))

state()
for name in {names!r}:
    ablate.SWITCHES[name]()
state()
"""


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """Start the three commands at once; each test waits for its own."""
    tmp = tmp_path_factory.mktemp("real_models")
    argv = {
        "quick": [os.path.join(SPEED, "real_models.py"), *QUICK, "--pairs", *PAIRS, "--runs", "2", "--steps", "2"],
        # real_models_ablate.py hands what follows `--` to real_models.py with its note; --control: torch's
        # engine in both columns (the harness's own bias); --minidp-first: the build order; --split-backward:
        # each backward's tail after its last gradient
        "options": [os.path.join(SPEED, "real_models_ablate.py"), "--off", *OFF, "--", *QUICK, "--pairs", "ddp",
                    "--runs", "1", "--steps", "2", "--control", "--minidp-first", "--split-backward"],
        "switches": ["-c", CHECK_SWITCHES.format(here=SPEED, names=list(OFF))],
    }
    started = {}
    for name, args in argv.items():
        json_args = [] if name == "switches" else ["--json", str(tmp / f"{name}.json")]
        started[name] = (subprocess.Popen([sys.executable, "-W", "ignore", *args, *json_args], cwd=ROOT,
                                          env=clean_env(MINIDP_START_METHOD="fork"), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True), tmp / f"{name}.json")
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()


def finished(commands, name):
    """(stdout, the JSON it wrote or None) of a command that exited 0."""
    proc, path = commands[name]
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out, json.loads(path.read_text()) if path.exists() else None


def test_real_models_quick(commands):
    stdout, result = finished(commands, "quick")
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
            # every rank's CPU a step, gathered to rank 0, whose own is the phases' figure
            assert len(row["cpu_by_rank"][side]) == 2 and all(c > 0 for c in row["cpu_by_rank"][side])
            assert row["cpu_by_rank"][side][0] == phases["cpu"]
    # the same collectives for the same options, whoever issues them
    assert all(r["colls_torch"] == r["colls_minidp"] for r in result["rows"])
    # each column ran its own engine
    assert all(r["engines"]["minidp"].startswith("minidp.") and r["engines"]["torch"].startswith("torch.")
               for r in result["rows"]), [r["engines"] for r in result["rows"]]


def test_real_models_options(commands):
    """The options, in one command (each launch costs seconds)."""
    stdout, result = finished(commands, "options")
    assert "CONTROL" in stdout and "minidp built first" in stdout and "tail" in stdout
    assert "minidp ablated: watchdog small-batch hold-back" in stdout
    assert result["config"]["note"] == "minidp ablated: watchdog small-batch hold-back"
    assert result["config"]["build_order"] == ["minidp", "torch"]
    row, = result["rows"]
    torch_ddp = "torch.nn.parallel.distributed.DistributedDataParallel"
    assert row["engines"]["torch"].startswith(torch_ddp) and row["engines"]["minidp"].startswith(torch_ddp)
    assert row["sequence"] == "tmmt"
    for side in ("torch", "minidp"):
        phases = row["phases"][side]
        assert 0 < phases["tail"] < phases["backward"], phases


def test_ablate_switches_take_effect(commands):
    stdout, _ = finished(commands, "switches")
    unpatched, patched = stdout.split("\n")[:2]
    # unpatched: the watchdog needs a store (None fails), small gradients are batched, the last bucket waits
    assert unpatched.split() == ["raised", "True", "0"], stdout
    assert patched.split() == ["True", "False", "1"], stdout
