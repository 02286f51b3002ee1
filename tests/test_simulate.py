"""minidp.simulate: the alpha-beta costs, the fit, DDP's bucket cut, the step model, a recorded timeline, the CLI."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import minidp
from harness import run_ranks, workers_forked
from minidp.study.network import Link, Network, allreduce_time, fit_ring, measure_allreduce
from minidp.study.simulate import MIB, Profile, best_cap, bucket_indices, plan_buckets, scaling, simulate_step
from models import MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST, SLOW = Link(1e-5, 1e10), Link(1e-4, 1e9)


def _record_second_step(model, batch: int):
    """Two steps (the first learns the ready order, the second runs the rebuilt buckets): the second's
    timeline events, and the parameters' byte sizes."""
    for _ in range(2):
        timeline = model.enable_timeline()
        timeline.record("forward_start")
        loss = model(torch.randn(batch, 8)).pow(2).mean()
        timeline.record("backward_start")
        loss.backward()
        timeline.record("step_end")
    sizes = {n: p.numel() * p.element_size() for n, p in model.module.named_parameters()}
    return timeline.snapshot(), sizes


def test_allreduce_costs():
    one_node = Network(FAST, SLOW, ranks_per_node=8)
    s = 8 * MIB
    assert allreduce_time(s, 1, one_node) == 0.0
    assert allreduce_time(s, 2, one_node) == pytest.approx(2 * 1e-5 + s / 1e10)  # 2(n-1)a + 2(n-1)/n S b
    assert allreduce_time(s, 8, one_node) == pytest.approx(14 * 1e-5 + 2 * 7 / 8 * s / 1e10)
    assert allreduce_time(s, 16, one_node) == pytest.approx(30 * 1e-4 + 2 * 15 / 16 * s / 1e9)  # slowest link
    tree = Network(FAST, SLOW, ranks_per_node=8, algorithm="tree")
    assert allreduce_time(s, 64, tree) == pytest.approx(2 * (3 * (1e-5 + s / 1e10) + 3 * (1e-4 + s / 1e9)))
    small = 1024  # latency-bound: the tree's log2(n) beats the ring's n at scale
    assert allreduce_time(small, 1024, tree) < allreduce_time(small, 1024, Network(FAST, SLOW, 8))
    with pytest.raises(ValueError, match="algorithm='mesh'"):
        Network(FAST, SLOW, algorithm="mesh")
    with pytest.raises(ValueError, match="bandwidth=0"):
        Link(1e-5, 0)


def test_fit_recovers_the_link():
    truth = Network(Link(3e-4, 2e9), Link(3e-4, 2e9), ranks_per_node=4)
    sweep = {s: allreduce_time(s, 4, truth) for s in (1024, 65536, 4 * MIB, 64 * MIB)}
    fitted = fit_ring(sweep, 4)
    assert fitted.latency_s == pytest.approx(3e-4) and fitted.bandwidth == pytest.approx(2e9)


def _profile(sizes, ready, backward=0.1):
    return Profile(forward_s=0.05, names=[f"p{i}" for i in range(len(sizes))], ready_s=ready, nbytes=sizes,
                   backward_s=backward, finalize_s=0.002, optimizer_s=0.01)


CAPS = (None, 0.004, 0.05)  # MiB; None: DDP's default, 1 MiB first, then 25


def _ddp_layouts_worker():
    """For each cap: one recorded step of minidp.DDP after its buckets were rebuilt, and its bucket_plan()."""
    torch.manual_seed(0)
    out = {}
    for cap in CAPS:
        # width 1024: a 4 MiB weight, so the default's 1 MiB first bucket closes before the rest.
        model = minidp.DDP(MLP(width=1024), bucket_cap_mb=cap)
        out[cap] = (*_record_second_step(model, batch=4), model.bucket_plan())
    return out


def test_simulated_buckets_are_the_ones_ddp_builds():
    # What simulate's predictions rest on: the buckets it cuts from a recorded step are the ones
    # minidp.DDP really launched in that step (same gradients, same order), for the default and other caps.
    recorded = run_ranks(_ddp_layouts_worker, 2)[0]
    for cap, (events, sizes, ddp_plan) in recorded.items():
        profile = Profile.from_events(events, sizes)
        simulated = [[profile.names[i] for i in bucket] for bucket in bucket_indices(profile, cap)]
        assert simulated == ddp_plan, f"bucket_cap_mb={cap}"
        assert len(ddp_plan) > 1, f"bucket_cap_mb={cap}: one bucket tells nothing about the cut"
        nbytes = [sum(sizes[name] for name in bucket) for bucket in ddp_plan]
        assert [b for b, _ in plan_buckets(profile, cap)] == nbytes


def test_step_model_by_hand():
    # Two 10 MB buckets ready at 40 ms and 100 ms; each all-reduce takes 2a + S/B = 20 ms at 2 ranks.
    link = Link(0.0, 10e6 / 0.02)
    profile = _profile([10_000_000, 10_000_000], [0.04, 0.1])
    over = simulate_step(profile, Network(link, link), 2, bucket_cap_mb=9)
    # bucket 0: 40-60 ms, bucket 1: 100-120 ms; backward ends at 100 ms, so 20 ms are exposed.
    assert over["step_s"] == pytest.approx(0.05 + 0.12 + 0.002 + 0.01)
    assert over["comm_s"] == pytest.approx(0.04) and over["hidden"] == pytest.approx(0.5)
    assert over["efficiency"] == pytest.approx(profile.compute_s / over["step_s"])
    shared = simulate_step(profile, Network(link, link, shared_cores=True), 2, bucket_cap_mb=9)
    assert shared["step_s"] == pytest.approx(profile.compute_s + 0.04) and shared["hidden"] == pytest.approx(0.0)
    assert simulate_step(profile, Network(link, link), 1)["step_s"] == pytest.approx(profile.compute_s)
    half = simulate_step(profile, Network(link, link, shared_cores=True), 2, 9, compression=0.5)
    assert half["comm_s"] == pytest.approx(0.02)
    rows = scaling(profile, Network(link, link, ranks_per_node=4))
    assert [r["world_size"] for r in rows] == [2 ** k for k in range(11)]
    assert all(a["step_s"] <= b["step_s"] for a, b in zip(rows, rows[1:]))  # slower links past one node
    assert best_cap(profile, Network(link, link), 2, [9, 100])[0] == 9  # overlap beats one late bucket


def _record_one_step():
    """A real timeline of one step (world size 1) and the parameters' sizes.

    In a worker: a process group in the pytest process leaves gloo's and the store's threads behind,
    and every later test would then have to spawn its workers instead of forking them.
    """
    return run_ranks(_record_one_step_worker, 1, init=False)[0]


def _record_one_step_worker():
    minidp.init(rank=0, world_size=1, backend="gloo")
    try:
        torch.manual_seed(0)
        model = minidp.DDP(MLP(width=256), bucket_cap_mb=0.05)
        return _record_second_step(model, batch=16)
    finally:
        minidp.shutdown()


def test_recorded_timeline_and_command_line(tmp_path):
    events, sizes = _record_one_step()
    profile = Profile.from_events(events, sizes)
    assert profile.names[0] == "net.4.bias" and sorted(profile.names) == sorted(sizes)  # last layer first
    assert profile.ready_s == sorted(profile.ready_s) and 0 < profile.ready_s[-1] <= profile.backward_s
    path = tmp_path / "events.json"
    path.write_text(json.dumps({"params": [[n, 0, b] for n, b in sizes.items()], "events": {"0": events}}))
    proc = subprocess.run([sys.executable, "-m", "minidp.simulate", "--events", str(path), "--json",
                           "--plot", str(tmp_path / "s.png"), "--caps", "0.05,1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["world_size"] for r in out["rows"]] == [2 ** k for k in range(1, 11)]
    assert all(0 < r["efficiency"] <= 1 and 0 <= r["hidden"] <= 1 for r in out["rows"])
    assert set(out["caps"]["1024"]["steps"]) == {"0.05", "1.0"}
    assert os.path.getsize(tmp_path / "s.png") > 10_000
    with pytest.raises(ValueError, match="no \\['backward_start'"):
        Profile.from_events([e for e in events if e[0] != "backward_start"], sizes)


def test_command_line_errors(capsys):
    from minidp.study.simulate import main
    for argv, message in ((["--world-sizes", "2,0"], "--world-sizes=0 must be >= 1"),
                          ([], "give --events FILE"),
                          (["--events", "/no/such/file.json"], "No such file")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err


def test_measured_sweep_fits_a_link():
    with workers_forked():  # its 2 ranks forked from this process (the harness's choice), not spawned
        # sizes 4,000x apart and 5 repeats: under other jobs' load, 1 and 4 MiB with 3 repeats once
        # measured the larger faster, and the fit's bandwidth came out negative
        sweep = measure_allreduce(2, sizes=(4096, 4 << 20, 16 << 20), repeats=5)
    link = fit_ring(sweep, 2)
    assert set(sweep) == {4096, 4 << 20, 16 << 20} and all(t > 0 for t in sweep.values())
    assert link.latency_s >= 0 and math.isfinite(link.bandwidth) and link.bandwidth > 0


@pytest.mark.parametrize("flags, line", [
    (["--world-sizes", "2,abc"], "--world-sizes='2,abc': 'abc' is not an integer; give a comma-separated list, "
                                 "e.g. --world-sizes 2,8,64"),
    (["--plot", "{tmp}/a_file/scaling.png"], "--plot='{tmp}/a_file/scaling.png' cannot be written: "
                                              "'{tmp}/a_file' is a file, not a folder"),
])
def test_bad_flags_are_one_line_before_any_work(tmp_path, flags, line):
    """The real command, as a user types it: one error line, exit 2, no traceback, nothing printed or drawn."""
    (tmp_path / "a_file").write_text("")
    events = os.path.join(ROOT, "benchmarks", "results", "explain_world1", "explain_resnet18_events.json")
    proc = subprocess.run([sys.executable, "-m", "minidp.simulate", "--events", events,
                           *[f.format(tmp=tmp_path) for f in flags]],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.splitlines() == ["python -m minidp.simulate: error: " + line.format(tmp=tmp_path)], proc.stderr
