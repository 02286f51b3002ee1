"""The compression study and the GPU check as commands: tiny runs of the real scripts, and their argument checks.

benchmarks/gpu/gpu_check.py is written for a GPU; here it runs its CPU dry run (gloo, the CuPy rows
reported as skipped), which goes through the same checks except the CUDA device, CupyNccl and the
host-sync count (set_sync_debug_mode needs CUDA).
"""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/ is not a package: the scripts' folders go on the path, as each script puts its own there.
sys.path[:0] = [os.path.join(ROOT, "benchmarks", folder) for folder in ("compression", "gpu", "shared")]

import shared_cores  # noqa: E402

import compression_report  # noqa: E402
import gpu_check  # noqa: E402
import study as compression  # noqa: E402 - benchmarks/compression/study.py

LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def _run(*cmd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = ROOT
    # The tools' workers fork (what they check and write is tested, not spawn), from a parent that ran no
    # parallel torch op (one thread: a forked child cannot use an OpenMP pool its parent started).
    env.update(MINIDP_START_METHOD="fork", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


STREAMING = "Streaming DiLoCo /8"


def test_compression_study_quick_run_writes_the_study(tmp_path):
    """The real script, tiny: one launch at world size 2 (one lr each; the choice among several is tested below),
    the payload phase (one rank) and the report. The cost phase and simulate --study are left to
    tests/test_time_to_target.py's fixture: each launch here costs seconds of torch imports. DeMo, 1-bit Adam
    and Streaming DiLoCo: the collectives the simulator reads are the bytes each method counted (12 steps: 1-bit
    Adam compresses from step 6, Streaming DiLoCo runs one period of 8 local steps after a warm-up of 4, so each
    of its 2 fragments syncs once)."""
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("# notes kept\n")
    methods = ["exact", "TopK 1%+EF", "DeMo", "1-bit Adam", STREAMING]
    proc = _run("benchmarks/compression/study.py", "--quick", "--phases", "sweep,payload,report", "--methods",
                ",".join(methods), "--steps", "12", "--lrs", "0.1", "--adam-lrs", "0.003", "--out", str(tmp_path),
                "--results-md", str(results_md))
    assert proc.returncode == 0, proc.stderr
    # each run says so as it finishes (the full study runs for minutes)
    runs = re.findall(r"^sweep (\d)/5: (.+) lr ([\d.]+) seed 0: (\d+ steps to target|target not reached in 12 "
                      r"steps), final val loss [\d.e+]+, \d+ s$", proc.stdout, re.M)
    assert [(int(done), method, lr) for done, method, lr, _ in runs] == [
        (i + 1, m, "0.003" if m in ("DeMo", "1-bit Adam") else "0.1") for i, m in enumerate(methods)], proc.stdout
    study = json.loads((tmp_path / "compression_study.json").read_text())
    exact, topk = study["methods"]["exact"], study["methods"]["TopK 1%+EF"]
    # the payload phase (one rank): what one more rank's payload costs, and 1-bit Adam's compression, measured
    payload = json.loads((tmp_path / "compression_payload.json").read_text())
    assert payload["per_payload_s"]["exact"] == 0.0 and payload["per_payload_s"]["TopK 1%+EF"] > 0
    assert payload["onebit_compression_s"] > 0 and topk["payload_cost_s"] == payload["per_payload_s"]["TopK 1%+EF"]
    assert set(exact["sweep"]) == set(topk["sweep"]) == {"0.1"} and topk["lr"] == 0.1
    assert topk["bytes_measured"] == topk["bytes_analytical"] < topk["param_bytes"] == exact["bytes_measured"]
    assert {c["op"] for c in topk["collectives"]} == {"all_gather"}
    assert {c["op"] for c in exact["collectives"]} == {"all_reduce"}
    # a method's collectives are its own (minidp.DDP adds none to a comm hook's step since 3bb5da5, issue 39):
    # what the simulator reads of each, and nothing marked as minidp's
    for name, m in study["methods"].items():
        assert all(set(c) <= {"op", "bytes", "per_step", "scale", "overlap_steps"} for c in m["collectives"]), name
        assert {c["scale"] for c in m["collectives"]} <= {"fixed", "chunk"}, name
    assert sum(c["bytes"] for c in exact["collectives"]) == exact["param_bytes"]  # every gradient, once
    assert exact["steps_to_target"] == [exact["sweep"]["0.1"][0]] and len(exact["final_val_loss"]) == 1
    param_bytes = exact["param_bytes"]
    for name in ("TopK 1%+EF", "DeMo", "1-bit Adam", STREAMING):  # the simulator's bytes per step: what the
        m = study["methods"][name]  # method counted, no more
        assert sum(c["bytes"] * c["per_step"] for c in m["collectives"]) == m["bytes_measured"], name
    demo, onebit, streaming = (study["methods"][name] for name in ("DeMo", "1-bit Adam", STREAMING))
    assert [c["op"] for c in demo["collectives"]] == ["all_gather"] and demo["start_iter"] == 0
    assert 50 * demo["bytes_measured"] < param_bytes  # top 32 of each 64 x 64 DCT block, int16 indices
    assert onebit["start_iter"] == 6 and onebit["warmup_collectives"] == [
        {"op": "all_gather", "bytes": param_bytes, "per_step": 1, "scale": "fixed"}]  # the warm-up: every gradient
    assert [c["op"] for c in onebit["collectives"]] == ["all_to_all"] + ["all_gather"] * 3
    assert [c["scale"] for c in onebit["collectives"]] == ["fixed", "fixed", "chunk", "fixed"]  # the server chunk
    assert 16 * onebit["bytes_measured"] < param_bytes  # 1 bit of 32, twice, and 4 scales
    codes = [c["bytes"] for c in streaming["collectives"][0::2]]  # per fragment: codes, then scales
    assert sum(codes) == pytest.approx(param_bytes / 8, abs=2) and len(codes) == 2
    assert {(c["per_step"], c["overlap_steps"]) for c in streaming["collectives"]} == {(1 / 8, 1)}
    assert demo["bytes_to_target"] == [demo["steps_to_target"][0] * demo["bytes_measured"]] or \
        demo["steps_to_target"] == [None]
    text = results_md.read_text()
    assert text.startswith("# notes kept\n") and "<!-- BEGIN compression cpu -->" in text and "| TopK 1%+EF |" in text


def test_the_lr_choice_and_the_sanity_verdicts():
    def row(method, lr, steps, final):
        return {"phase": "sweep", "method": method, "lr": lr, "steps_to_target": steps, "final_val_loss": final}
    rows = [row("a", 0.1, 200, 0.9), row("a", 0.2, 180, 1.0), row("a", 0.4, 180, 0.95),  # fewest steps, then loss
            row("b", 0.1, None, 2.0), row("b", 0.2, None, 1.5), row("b", 0.4, None, float("nan"))]  # never: loss
    assert compression.chosen_lrs(rows) == {"a": 0.4, "b": 0.2}

    def method(steps, finals):
        return {"steps_to_target": steps, "final_val_loss": finals}
    study = {"methods": {"exact": method([200, 210, 220], [0.70, 0.72, 0.74]),
                         "Sign": method([300, 320, None], [1.00, 1.10, 1.30]),
                         "Sign+EF": method([250, 260, 270], [0.90, 0.92, 0.95]),
                         "TopK 1%+EF": method([230, 250, 260], [0.74, 0.76, 0.80]),
                         "PowerSGD 4+EF": method([300, 310, 320], [0.71, 0.72, 0.73])}}
    verdicts = {check: verdict for check, verdict, _ in compression_report.sanity(study)}
    assert verdicts == {"EF-Sign at least as good as Sign": "reproduced", "TopK 1%+EF close to exact": "reproduced",
                        "PowerSGD 4+EF close to exact": "NOT reproduced"}  # 310 steps > 1.25 x 210


def test_a_cost_is_paired_with_the_compute_of_its_own_launch():
    """The machine's speed moves between launches (1.9 ms against 4.6 ms a day apart): each launch's share of
    its own no-communication step, the median over launches, at the fastest compute of any launch."""
    def row(method, step_s, phase="cost"):
        return {"phase": phase, "method": method, "per_rank_batch": 64, "median_step_s": step_s}
    rows = [row("noop", 4.0), row("m", 6.0), row("noop", 5.0), row("m", 5.0), row("m", 1.0, "sweep"),
            row("noop", 2.0), row("m", 3.0), row("Sign+EF", 6.0), row("m", 1.0, "seeds"),
            row("noop", 2.0), row("m", 2.2), row("1-bit Adam", 2.4), row("noop", 9.0, "validate")]
    compute_1, shares = compression_report.cost_shares(rows, 64)
    assert compute_1 == 2.0 and shares["m"] == pytest.approx(0.25)  # median of 5/4, 3/2 and 2.2/2, less 1
    # 1-bit Adam compresses nothing at world size 1: Sign+EF's share is added to its own
    assert compression_report._cost("1-bit Adam", shares, compute_1) == pytest.approx((0.2 + 2.0) * 2.0)
    # ... unless its own compression was measured (the payload phase): then that, in seconds
    assert compression_report._cost("1-bit Adam", shares, compute_1, 0.5) == pytest.approx(0.2 * 2.0 + 0.5)


def test_each_method_takes_its_cost_from_the_newest_invocation_that_measured_it():
    """Rows carry their invocation (batch) and launch (repeat): a launch is one (batch, repeat); a method's share
    comes from the newest batch that ran it, the compute from the newest batch's no-communication steps."""
    def row(method, step_s, batch, repeat):
        return {"phase": "cost", "method": method, "per_rank_batch": 64, "median_step_s": step_s,
                "batch": batch, "repeat": repeat}
    old = [row("noop", 4.0, "a", 0), row("m", 8.0, "a", 0), row("q", 6.0, "a", 0)]  # q: measured only then
    new = [row("noop", 2.0, "b", 0), row("m", 3.0, "b", 0), row("noop", 1.0, "b", 1), row("m", 1.2, "b", 1)]
    compute_1, shares = compression_report.cost_shares(old + new, 64)
    assert compute_1 == 1.0
    assert shares["m"] == pytest.approx((0.5 + 0.2) / 2)  # launches b/0 and b/1 apart, not one launch of b
    assert shares["q"] == pytest.approx(0.5)  # from batch a, the newest that measured it
    # a row's mean step where recorded (work once in k steps is in the mean, not the median)
    periodic = [row("noop", 2.0, "c", 0), {**row("p", 2.0, "c", 0), "mean_step_s": 3.0}]
    assert compression_report.cost_shares(periodic, 64)[1]["p"] == pytest.approx(0.5)


def test_the_report_reads_a_methods_collectives_from_its_newest_row_without_minidps_status(tmp_path):
    """2026-12-04's validation rows also list minidp.DDP's status all-reduce after a comm hook (marked engine),
    which minidp no longer issues since 3bb5da5: the study keeps the newest row's collectives but that one."""
    gather = {"op": "all_gather", "bytes": 12_508, "per_step": 1, "scale": "fixed"}
    status = {"op": "all_reduce", "bytes": 8, "per_step": 1, "scale": "ranks", "engine": True}

    def row(method, collectives, phase="sweep"):
        return {"phase": phase, "method": method, "lr": 0.1, "seed": 0, "world_size": 2, "steps_to_target": 200,
                "final_val_loss": 0.7, "bytes_measured": 25_016, "bytes_analytical": 25_016, "param_bytes": 1_251_184,
                "collectives": collectives, "method_start": 10}
    reduce = {"op": "all_reduce", "bytes": 1_251_184, "per_step": 1, "scale": "fixed"}
    rows = [row("exact", [reduce]), row("TopK 1%+EF", [gather]),
            row("TopK 1%+EF", [gather, gather, status], "validate")]
    args = compression.parse_args(["--out", str(tmp_path), "--methods", "exact,TopK 1%+EF"])
    study = compression_report.study(args, rows, {"exact": 0.1, "TopK 1%+EF": 0.1})
    assert study["methods"]["TopK 1%+EF"]["collectives"] == [gather, gather]  # the newest row's, less the status
    assert compression_report._collectives(study["methods"]["TopK 1%+EF"]) == "2 all-gather"
    assert study["methods"]["exact"]["collectives"] == [reduce]


def test_the_validation_reads_the_newest_batch_and_fits_each_launch_probes():
    """Each validate launch: no-communication runs around probes and methods; its link is fitted to the probes'
    medians less the launch's compute (a ring: T = 2 (N-1) a + 2 (N-1) / N * bytes / bandwidth)."""
    a, bandwidth, compute, world = 1e-3, 1e9, 0.004, 2
    OLDER = "2026-12-03T21:40:00+00:00"  # an earlier invocation's batch tag (ISO times sort as strings)

    def probe(nbytes):
        return 2 * (world - 1) * a + 2 * (world - 1) / world * nbytes / bandwidth + compute

    def row(method, step_s, batch="2026-12-04T07:06:09+00:00", **more):
        return {"phase": "validate", "world_size": world, "method": method, "median_step_s": step_s,
                "batch": batch, **more}
    stale = [row("noop", 0.5, OLDER), row("exact", 9.0, OLDER), row("noop", 0.5, OLDER)]
    launch = [row("noop", compute - 0.001), *(row("probe", probe(b), probe_bytes=b) for b in (4096, 1 << 20)),
              row("exact", 0.02), *(row("probe", probe(b), probe_bytes=b) for b in (1 << 20, 4096)),
              row("noop", compute + 0.001)]
    found = compression_report._launches(stale + launch, world)
    assert len(found) == 1 and list(found[0]["rows"]) == ["exact"]
    assert found[0]["compute_s"] == pytest.approx(compute)
    link = found[0]["link"]
    assert link["latency_s"] == pytest.approx(a) and link["bandwidth"] == pytest.approx(bandwidth)


def test_payload_cost_is_one_more_ranks_decompress_and_add_for_the_methods_that_all_gather():
    """QSGD's aggregate decompresses each rank's dense payload: more than zero per rank; methods that all-reduce
    (exact, FP16), decode 1/N chunks (Sign) or bring their own exchange (PowerSGD, DeMo, local SGD) add none."""
    import compression_task as task

    numels = (30_000, 300)
    for name in ("exact", "FP16", "Sign+EF", "PowerSGD 4+EF", "DeMo", "local SGD /4", "RandomK 1%"):
        assert task.payload_cost(name, numels, repeats=3) == 0.0, name
    assert task.payload_cost("QSGD 16", numels, repeats=5) > 0


def test_shared_cores_prints_each_part_median_spread_and_slowdown(capsys):
    """The table of benchmarks/compression/shared_cores.py: per part and world size the median over launches,
    their min-max, and the median over the part's median alone (W = 1); parts W = 1 has not: '-'."""
    result = {"1": {"cpu work": [0.001, 0.003, 0.002]},
              "2": {"cpu work": [0.004, 0.006, 0.005], "all-reduce fp32": [0.010, 0.030, 0.020]},
              "4": {"cpu work": [0.008, 0.007, 0.009], "all-reduce fp32": [0.040, 0.050, 0.060]}}
    lines = shared_cores.table(result).splitlines()
    assert lines[1].split() == ["cpu", "work", "2.00", "(1.00-3.00)", "1.00", "5.00", "(4.00-6.00)", "2.50",
                                "8.00", "(7.00-9.00)", "4.00"]
    assert lines[2].split() == ["all-reduce", "fp32", "-", "20.00", "(10.00-30.00)", "-", "50.00", "(40.00-60.00)",
                                "-"]
    with pytest.raises(SystemExit):
        shared_cores.main(["--launches", "0"])
    assert "--launches 0 must be >= 1" in capsys.readouterr().err


def _table_rows(stdout: str) -> list[dict]:
    header = ("| check ", "| ---")
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and not line.startswith(header)]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    return [dict(zip(("check", "world", "collectives", "result", "detail"), c)) for c in cells]


def test_gpu_check_dry_run_on_cpu_runs_every_check_and_counts_collectives(tmp_path):
    """What makes the GPU check trustworthy: a collectives column, every passing row communicated, 3+ rows
    at world size 2, SyncBatchNorm beside a compression hook passes; one verdict line per check."""
    results_md = tmp_path / "RESULTS.md"
    proc = _run("benchmarks/gpu/gpu_check.py", "--device", "cpu", "--quick", "--steps", "1", "--results-md",
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
    """The script itself on the GPU: every check, quick; CupyNccl may be skipped without CuPy."""
    proc = _run("benchmarks/gpu/gpu_check.py", "--quick", "--steps", "2", "--results-md", "", timeout=480)
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
    (compression, ["--methods", "exact,Zip"], "--methods: unknown ['Zip']"),
    (compression, ["--steps", "0"], "--steps 0 must be >= 1"),
    (compression, ["--lrs", "0.1,fast"], "--lrs '0.1,fast'"),
    (gpu_check, ["--device", "cpu", "--steps", "0"], "--steps 0 must be >= 1"),
    (gpu_check, ["--device", "cpu", "--checks", "engine,zip"], "choose from engine,status,cupy,compressors,world2"),
])
def test_benchmark_arguments_are_checked(module, argv, words, capsys):
    with pytest.raises(SystemExit):
        module.parse_args(argv)
    assert words in capsys.readouterr().err


def test_compression_help_lists_the_methods(capsys):
    with pytest.raises(SystemExit) as info:
        compression.parse_args(["--help"])
    assert info.value.code == 0 and "TopK 1%+EF" in capsys.readouterr().out


def test_a_compression_rerun_leaves_the_git_tree_clean():
    """Its default --out is under runs/, which .gitignore covers; the recorded study stays in benchmarks/results."""
    out = os.path.relpath(compression.parse_args([]).out, ROOT)
    assert out == os.path.join("runs", "compression"), out
    ignored = subprocess.run(["git", "check-ignore", "-q", os.path.join(out, "compression_runs.jsonl")], cwd=ROOT)
    assert ignored.returncode == 0, f"git does not ignore {out}"
    assert os.path.exists(os.path.join(ROOT, "benchmarks", "results", "compression_study.json"))


def test_gpu_check_refuses_cuda_without_a_gpu(capsys):
    if gpu_check.torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit):
        gpu_check.parse_args([])
    assert "use --device cpu for a dry run" in capsys.readouterr().err
