"""Smoke test of benchmarks/speed/real_models.py --quick: a real command, 2 forked ranks, tiny GPT-2.

No timing assertions (speed lives in benchmarks/RESULTS.md): the table's columns are there, every pair ran
both engines, and they took turns every step (the order flipped each step).
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from processes import clean_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = ("ddp_static", "fsdp")  # a DDP pair and a sharded one (the suite's time: each pair is seconds)


def test_real_models_quick(tmp_path):
    out = tmp_path / "real_models.json"
    cmd = [sys.executable, "-W", "ignore", os.path.join(ROOT, "benchmarks", "speed", "real_models.py"), "--quick",
           "--world-sizes", "2", "--models", "gpt2", "--pairs", *PAIRS, "--runs", "2", "--steps", "2",
           "--warmup", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(MINIDP_START_METHOD="fork"), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "held MiB" in proc.stdout and "loadavg before" in proc.stdout
    assert "ms t/m: forward" in proc.stdout and "cpu ms by rank t/m:" in proc.stdout
    result = json.loads(out.read_text())
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


ABLATE = os.path.join(ROOT, "benchmarks", "speed", "real_models_ablate.py")


def test_real_models_options(tmp_path):
    """One command for the options (each launch costs seconds): real_models_ablate.py hands what follows
    `--` to real_models.py with its note; --control: torch's engine in both columns (the harness's own
    bias); --minidp-first: build order; --split-backward: each backward's tail after its last gradient."""
    out = tmp_path / "options.json"
    cmd = [sys.executable, "-W", "ignore", ABLATE, "--off", "watchdog", "small-batch", "hold-back", "--",
           "--quick", "--world-sizes", "2", "--models", "gpt2", "--pairs", "ddp", "--runs", "1", "--steps", "2",
           "--warmup", "1", "--control", "--minidp-first", "--split-backward", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CONTROL" in proc.stdout and "minidp built first" in proc.stdout and "tail" in proc.stdout
    assert "minidp ablated: watchdog small-batch hold-back" in proc.stdout
    result = json.loads(out.read_text())
    assert result["config"]["note"] == "minidp ablated: watchdog small-batch hold-back"
    assert result["config"]["build_order"] == ["minidp", "torch"]
    row, = result["rows"]
    torch_ddp = "torch.nn.parallel.distributed.DistributedDataParallel"
    assert row["engines"]["torch"].startswith(torch_ddp) and row["engines"]["minidp"].startswith(torch_ddp)
    assert row["sequence"] == "tmmt"
    for side in ("torch", "minidp"):
        phases = row["phases"][side]
        assert 0 < phases["tail"] < phases["backward"], phases

# After the switches: the watchdog starts nothing, no gradient counts as small, and a full last bucket
# launches before the end of backward (a stand-in reducer with one full bucket: held back unpatched).
CHECK_SWITCHES = """
import sys, types
sys.argv = ["x"]
sys.path.insert(0, {here!r})
import real_models_ablate as ablate
for name in {names!r}:
    ablate.SWITCHES[name]()
import minidp.engine.layout as layout, minidp.runtime.watchdog as watchdog
from minidp.engine.reducer import Reducer
from minidp.engine.step import Step
bucket = types.SimpleNamespace(index=0, param_indices=[0])
step = Step([bucket], 1, None)
step.pending[0] = 0
fake = types.SimpleNamespace(layout=types.SimpleNamespace(buckets=[bucket]), iteration=1,
                             recorder=types.SimpleNamespace(launch=lambda *a: None, watch=lambda *a: None),
                             reduce=lambda b, buf: "future")
bucket.buffer = None
Reducer.launch_ready_buckets(fake, step)
try:
    started = watchdog.start(None, 0, 2) is None and watchdog.current() is None
except Exception:  # the real watchdog needs a store
    started = "raised"
print(started, layout.SMALL_GRAD_NUMEL > 0, len(step.futures))
"""


def test_ablate_switches_take_effect():
    here = os.path.join(ROOT, "benchmarks", "speed")
    on = subprocess.run([sys.executable, "-c", CHECK_SWITCHES.format(here=here, names=[])], cwd=ROOT,
                        env=clean_env(), capture_output=True, text=True, timeout=120)
    # unpatched: the watchdog needs a store (None fails), small gradients are batched, the last bucket waits
    assert on.returncode == 0, on.stderr[-2000:]
    assert on.stdout.split() == ["raised", "True", "0"], on.stdout
    off = subprocess.run([sys.executable, "-c", CHECK_SWITCHES.format(
        here=here, names=["watchdog", "small-batch", "hold-back"])], cwd=ROOT, env=clean_env(),
        capture_output=True, text=True, timeout=120)
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split() == ["True", "False", "1"], off.stdout
