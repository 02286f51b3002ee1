"""python -m minidp.simulate --study: time to target at scale from a study file, checked against the formula by hand."""
import json
import math

import pytest

from minidp.study import simulate, validation
from minidp.study import time_to_target as ttt

GBIT, LATENCY = 10, 15e-6
BW = GBIT * 1e9 / 8  # bytes per second


def _study():
    """Four methods: exact (two all-reduces), TopK-like (an all-gather), Sign-like (all-to-all and a chunked
    all-gather), local SGD-like (an all-reduce every 4 steps)."""
    return {
        "target": 1.2, "metric": "validation loss", "world_size": 2, "start_iter": 10,
        "compute_s": {"1": 0.010, "2": 0.012, "4": 0.025},
        "network": {"2": {"latency_s": 4e-4, "bandwidth": 1e9}, "4": {"latency_s": 1e-3, "bandwidth": 5e8}},
        "methods": {
            "exact": {"steps_to_target": [200, 210, 230], "cost_s": -0.0001,
                      "collectives": [{"op": "all_reduce", "bytes": 1_200_000, "per_step": 1, "scale": "fixed"},
                                      {"op": "all_reduce", "bytes": 12_000, "per_step": 1, "scale": "fixed"}],
                      "measured": {"2": {"runs": [{"time_to_target_s": 5.0, "step_s": 0.025, "compute_s": 0.012}]}}},
            "topk": {"steps_to_target": [212, None, 208], "cost_s": 0.0,
                     "collectives": [{"op": "all_gather", "bytes": 240_000, "per_step": 1, "scale": "fixed"}],
                     "measured": {"2": {"runs": [{"time_to_target_s": 4.0, "step_s": 0.016, "compute_s": 0.012}]},
                                  "4": {"runs": [{"time_to_target_s": 9.0, "step_s": 0.04, "compute_s": 0.025},
                                                 {"time_to_target_s": 12.0, "step_s": 0.05, "compute_s": 0.035}]}}},
            "sign": {"steps_to_target": [None, None, 300], "cost_s": 0.01,
                     "collectives": [{"op": "all_to_all", "bytes": 40_000, "per_step": 1, "scale": "fixed"},
                                     {"op": "all_gather", "bytes": 20_000, "per_step": 1, "scale": "chunk"}]},
            "local": {"steps_to_target": [220, 220, 260], "cost_s": 0.0,
                      "collectives": [{"op": "all_reduce", "bytes": 1_212_000, "per_step": 0.25, "scale": "fixed"}]},
        },
    }


def _by_hand(n):
    """Time to target (median over seeds) of exact and topk at n ranks, 10 Gb/s, 15 us, written out."""
    exact_step = 0.010 + sum(2 * (n - 1) * LATENCY + 2 * (n - 1) / n * b / BW for b in (1_200_000, 12_000))
    topk_step = 0.010 + (n - 1) * (LATENCY + 240_000 / BW)  # every rank receives the n-1 others' payloads
    exact = [9 * exact_step + (s - 10) * exact_step for s in (200, 210, 230)]
    topk = [9 * exact_step + (s - 10) * topk_step for s in (212, 208)]  # the seed that never reached: infinite
    return exact[1], topk, exact_step, topk_step


def test_one_cell_of_the_table_is_the_formula_written_out():
    table = ttt.relative_table(_study(), world_sizes=(8, 1024), bandwidths=(GBIT,), latency_us=15)
    for n in (8, 1024):
        exact, topk, _, _ = _by_hand(n)
        med, low, high = table[(GBIT, n)]["topk"]
        assert med == pytest.approx(max(topk) / exact, rel=1e-12)  # the median of (208, 212, never) is 212's
        assert low == pytest.approx(min(topk) / exact, rel=1e-12) and math.isinf(high)
        assert table[(GBIT, n)]["exact"][0] == 1.0
        assert math.isinf(table[(GBIT, n)]["sign"][0])  # two of three seeds never reached it
    # all-gather grows with n, the ring all-reduce hardly: TopK wins at 8 ranks and loses at 1,024
    assert table[(GBIT, 8)]["topk"][0] < 1 < table[(GBIT, 1024)]["topk"][0]
    assert ttt.fastest(table[(GBIT, 1024)])[0] == "local"


def test_chunked_all_gather_and_all_to_all_follow_their_formulas():
    net = ttt.flat_network(GBIT, 15)
    sign = _study()["methods"]["sign"]
    n = 8
    a2a = (n - 1) * LATENCY + (n - 1) / n * 40_000 / BW
    gather = (n - 1) * (LATENCY + 20_000 * 2 / n / BW)  # the server chunk is 1/n of the signs: 2/8 of world 2's
    assert ttt.comm_time(sign, n, net, study_world=2) == pytest.approx(a2a + gather, rel=1e-12)
    assert ttt.collective_time("all_gather", 100, 1, net) == 0.0
    with pytest.raises(ValueError, match="op='broadcast'"):
        ttt.collective_time("broadcast", 100, 8, net)


def test_own_warmups_and_overlapped_syncs_follow_their_formulas():
    """DeMo (no warm-up: every step its all-gather), 1-bit Adam (its own warm-up of all-gathered gradients,
    then Sign's stages) and Streaming DiLoCo (a fragment's all-gather every 4 steps, overlapped with one step:
    only what the step does not cover counts, and with shared cores all of it), written out at 8 ranks."""
    study = _study()
    study["methods"].update({
        "demo": {"steps_to_target": [250], "cost_s": 0.002, "start_iter": 0,
                 "collectives": [{"op": "all_gather", "bytes": 17_664, "per_step": 1, "scale": "fixed"}]},
        "onebit": {"steps_to_target": [230], "cost_s": 0.003, "start_iter": 40,
                   "warmup_collectives": [{"op": "all_gather", "bytes": 1_212_000, "per_step": 1, "scale": "fixed"}],
                   "collectives": [{"op": "all_to_all", "bytes": 38_000, "per_step": 1, "scale": "fixed"},
                                   {"op": "all_gather", "bytes": 19_000, "per_step": 1, "scale": "chunk"}]},
        "streaming": {"steps_to_target": [300], "cost_s": 0.0,
                      "collectives": [{"op": "all_gather", "bytes": 5_000_000, "per_step": 0.25, "scale": "fixed",
                                       "overlap_steps": 1}]}})
    n, net = 8, ttt.flat_network(GBIT, 15)
    _, _, exact_step, _ = _by_hand(n)
    gather = lambda b: (n - 1) * (LATENCY + b / BW)  # noqa: E731
    demo = 0.012 + gather(17_664)
    assert ttt.time_to_target(study, "demo", n, net) == [pytest.approx(249 * demo, rel=1e-12)]
    onebit = 0.013 + (n - 1) * LATENCY + (n - 1) / n * 38_000 / BW + gather(19_000 * 2 / n)
    warm = 0.013 + gather(1_212_000)
    assert ttt.time_to_target(study, "onebit", n, net) == [pytest.approx(39 * warm + 190 * onebit, rel=1e-12)]
    sync = gather(5_000_000)
    assert sync > 0.010  # more than the step it overlaps
    streaming = 0.010 + 0.25 * (sync - 0.010)
    assert ttt.time_to_target(study, "streaming", n, net) == [pytest.approx(9 * exact_step + 290 * streaming)]
    shared = ttt.Network(net.intra, net.inter, 1, shared_cores=True)
    assert ttt.step_time(study, "streaming", n, shared) == pytest.approx(0.010 + 0.25 * sync, rel=1e-12)


def test_every_collective_a_method_lists_counts_in_the_map_as_in_a_step():
    """A method's collectives are its own (minidp.DDP adds none to a comm hook's step since 3bb5da5): each
    one counts alike in a step's prediction (the validation's) and in the map; none is left out."""
    study = _study()
    extra = {"op": "all_reduce", "bytes": 8, "per_step": 1, "scale": "fixed"}
    study["methods"]["topk"]["collectives"].append(extra)
    n, net = 8, ttt.flat_network(GBIT, 15)
    exact, _, exact_step, topk_step = _by_hand(n)
    ring = 2 * (n - 1) * LATENCY + 2 * (n - 1) / n * 8 / BW
    assert ttt.step_time(study, "topk", n, net) == pytest.approx(topk_step + ring, rel=1e-12)
    topk = [9 * exact_step + (s - 10) * (topk_step + ring) for s in (212, 208)]
    assert ttt.relative_table(study, world_sizes=(n,), bandwidths=(GBIT,))[(GBIT, n)]["topk"][0] == pytest.approx(
        max(topk) / exact, rel=1e-12)


def test_a_study_file_of_2026_12_04_is_read_without_minidps_status_all_reduce(tmp_path):
    """Files written before 3bb5da5 list minidp.DDP's status all-reduce after a comm hook (marked engine, one
    int32 per rank: scale "ranks"); load() drops it, and the model refuses a scale it does not know."""
    study = _study()
    status = {"op": "all_reduce", "bytes": 8, "per_step": 1, "scale": "ranks", "engine": True}
    study["methods"]["topk"]["collectives"].append(status)
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    assert ttt.load(str(path))["methods"]["topk"]["collectives"] == _study()["methods"]["topk"]["collectives"]
    n, net = 8, ttt.flat_network(GBIT, 15)
    assert ttt.step_time(ttt.load(str(path)), "topk", n, net) == pytest.approx(_by_hand(n)[3], rel=1e-12)
    with pytest.raises(ValueError, match=r"scale='ranks', choose from \('fixed', 'chunk'\)"):
        ttt.step_time(study, "topk", n, net)


def test_a_validation_run_is_predicted_for_its_own_steps_and_link():
    """A run that recorded its steps to the target and its launch's in-step link is predicted with those, not
    with the seeds' median steps and the study's network."""
    study = _study()
    run = {"time_to_target_s": 4.0, "step_s": 0.016, "compute_s": 0.012, "steps_to_target": 150,
           "link": {"latency_s": 2e-3, "bandwidth": 2e8}}
    study["methods"]["topk"]["measured"] = {"2": {"runs": [run]}}
    row = [r for r in validation.validate(study) if r[:2] == (2, "topk")][0]
    a, bw = 2e-3, 2e8
    exact = 0.012 + sum(2 * a + b / bw for b in (1_200_000, 12_000))  # ring at 2 ranks: 2 (N-1) = 2 messages
    topk = 0.012 + a + 240_000 / bw
    assert row[2] == pytest.approx(9 * exact + (150 - 10) * topk, rel=1e-12) and row[7] == pytest.approx(topk)


def test_each_more_ranks_payload_adds_to_the_cost_and_costs_slow_down_with_the_same_batchs_compute():
    """payload_cost_s: what aggregating one more rank's payload costs (a method that all-gathers decompresses N);
    the cost scales with compute_s over the compute of the same per-rank batch alone (compute_1_s)."""
    study = _study()
    study["methods"]["topk"].update(cost_s=0.002, payload_cost_s=0.0001)
    n, net = 8, ttt.flat_network(GBIT, 15)
    _, _, _, topk_step = _by_hand(n)
    assert ttt.step_time(study, "topk", n, net) == pytest.approx(topk_step + 0.002 + 7 * 0.0001, rel=1e-12)
    # compute 0.012 at this batch where the same batch alone takes 0.006: the cost doubles, not x1.2
    slowed = ttt.step_time(study, "topk", n, net, compute_s=0.012, compute_1_s=0.006)
    assert slowed == pytest.approx(topk_step - 0.010 + 0.012 + 2 * (0.002 + 7 * 0.0001), rel=1e-12)
    # sync_s: once in a step that communicates (per_step 1 here), once in 4 for local SGD's every-4-steps
    assert ttt.step_time(study, "topk", n, net, sync_s=0.003) == pytest.approx(
        ttt.step_time(study, "topk", n, net) + 0.003, rel=1e-12)
    assert ttt.step_time(study, "local", n, net, sync_s=0.004) == pytest.approx(
        ttt.step_time(study, "local", n, net) + 0.001, rel=1e-12)


def test_cli_prints_the_table_draws_the_plot_and_validates(tmp_path, capsys):
    path = tmp_path / "study.json"
    path.write_text(json.dumps(_study()))
    plot = tmp_path / "pays_off.png"
    assert simulate.main(["--study", str(path), "--bandwidths", "10,400", "--world-sizes", "8,1024",
                          "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    exact, topk, _, _ = _by_hand(8)
    assert f"{max(topk) / exact:.2f} ({min(topk) / exact:.2f}-inf)" in out and "400 Gb/s" in out
    assert plot.stat().st_size > 5000
    assert simulate.main(["--study", str(path), "--methods", "topk", "--world-sizes", "8", "--bandwidths", "10"]) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()[3:]]
    assert rows == ["exact", "topk", "fastest"]  # only the methods asked for, beside exact
    assert simulate.main(["--study", str(path), "--validate"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("2", "exact"), ("2", "topk"), ("4", "topk")]
    # world 4, topk, one run per launch: that launch's compute, the cost slowed as the compute, the link fitted at 4
    a, bw = 1e-3, 5e8
    errors = []
    for compute, measured in ((0.025, 9.0), (0.035, 12.0)):
        exact4 = compute + sum(2 * 3 * a + 2 * 3 / 4 * b / bw for b in (1_200_000, 12_000))
        topk4 = compute + 3 * (a + 240_000 / bw)  # cost 0
        errors.append((9 * exact4 + (212 - 10) * topk4) / measured - 1)
    assert rows[2][4] == f"{100 * (errors[0] + errors[1]) / 2:+.0f}%"  # the median of two runs: their mean
    assert rows[2][5] == "(2:" and rows[2][6] == f"{100 * min(errors):+.0f}..{100 * max(errors):+.0f}%)"


@pytest.mark.parametrize("change, words", [
    (lambda s: s["methods"].pop("exact"), "no 'exact' method"),
    (lambda s: s.pop("compute_s"), "no ['compute_s']"),
    (lambda s: s["methods"]["exact"].update(steps_to_target=[None, None, 5]), "exact never reached the target"),
    (lambda s: s["methods"].pop("topk"), "--methods: ['topk'] not in the study"),
    (lambda s: s["methods"]["topk"]["collectives"][0].update(scale="ranks"), "scale='ranks', choose from"),
])
def test_a_bad_study_file_is_named(tmp_path, capsys, change, words):
    study = _study()
    change(study)
    path = tmp_path / "study.json"
    path.write_text(json.dumps(study))
    with pytest.raises(SystemExit):
        simulate.main(["--study", str(path), "--methods", "topk"])
    assert words in capsys.readouterr().err
