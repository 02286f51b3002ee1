"""Check minidp.simulate against what can be measured here: a gloo sweep, steps at world size 2, a cap sweep.

    flock /tmp/minidp-cpu.lock python benchmarks/simulator/simulate_check.py      # ~4 minutes on 2 cores
    python benchmarks/simulator/simulate_check.py --record    # into benchmarks/results/, what RESULTS.md shows

1. Compute profiles of the benchmark workloads (mlp, resnet18 32x32, as in RESULTS.md), recorded with
   minidp's timeline (a) at world size 2 with a comm hook that sends nothing (both ranks compute at
   once, no communication), (b) at world size 1 (what `python -m minidp.explain --world-size 1` records).
2. Measured at world size 2 in the same processes, in alternating rounds: the median step under minidp
   for DDP's default buckets and caps 1, 5, 25, 100 MiB, and gloo all-reduces of 1 KiB ... 96 MiB,
   fitted to a ring link (alpha-beta).
Then the simulator predicts each measured step from (a) and from (b) with the fitted network (shared
cores: gloo needs the cores the ranks compute on), and picks the best cap. Writes simulate_check.json and
simulate_resnet18_cluster.png into --out (default runs/simulator/ in the checkout, which git ignores: a
rerun leaves the tree clean; --record: benchmarks/results/, the recorded run) and prints the tables for
RESULTS.md. Rank 0 prints a line per phase and per round (the run is minutes long).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(HERE)  # RESULTS.md and results/ live here
RECORDED = os.path.join(BENCHMARKS, "results")  # --record: the files RESULTS.md shows
DEFAULT_OUT = os.path.join(os.path.dirname(BENCHMARKS), "runs", "simulator")  # git ignores runs/
# benchmarks/ is not a package: this folder and shared/ (workloads, worker processes) go on the path.
sys.path[:0] = [HERE, os.path.join(BENCHMARKS, "shared")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from heartbeat import heartbeat  # noqa: E402  (shared/heartbeat.py: a line every 30 s while ranks run)

import minidp  # noqa: E402
import workloads  # noqa: E402
from minidp.study.network import CLUSTER, Link, Network, fit_ring  # noqa: E402
from minidp.study.plot import check_writable  # noqa: E402
from minidp.study.simulate import Profile, best_cap, scaling, simulate_step  # noqa: E402

CAPS = (None, 1, 5, 25, 100)
SWEEP = tuple(4 ** k * 1024 for k in range(9)) + (96 << 20,)  # 1 KiB ... 64 MiB, 96 MiB
NAMES = ("mlp", "resnet18")


def _no_comm_hook(state, bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())  # nothing sent: the step's compute alone
    return future


def _timed_step(model, opt, x, y, timeline=None):
    mark = timeline.record if timeline is not None else (lambda kind: None)
    start = time.perf_counter()
    mark("forward_start")
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    mark("backward_start")
    loss.backward()
    opt.step()
    mark("step_end")
    return time.perf_counter() - start


def _no_comm_model(load):
    """The workload under minidp with a comm hook that sends nothing: each step is the compute alone."""
    model = minidp.DDP(load.build(seed=0), bucket_cap_mb=None)
    model.register_comm_hook(None, _no_comm_hook)
    return model


def _measure(loads, rounds=6, per_round=3):
    """Median step time per workload and cap, and the all-reduce sweep, interleaved in rounds.

    Everything alternates (caps in forward, then backward order) and the sweep runs in the same
    processes between the blocks, so that the machine's load, which moves by 2x on this shared VM,
    falls on all of them alike.
    """
    runs, start = {}, time.perf_counter()
    for name, (load, x, y) in loads.items():
        _say(f"  warming up {name} under {len(CAPS) + 1} bucket settings")
        for cap in CAPS + ("no_comm",):
            model = _no_comm_model(load) if cap == "no_comm" else minidp.DDP(load.build(seed=0), bucket_cap_mb=cap)
            runs[name, cap] = (model, workloads.make_optimizer(model), x, y)
            for _ in range(3):  # warm-up; the buckets are rebuilt after the first
                _timed_step(*runs[name, cap])
    times = {key: [] for key in runs}
    profiles = {name: [] for name in loads}  # the no-communication steps' timelines
    sweep = {size: [] for size in SWEEP}
    for r in range(rounds):
        for size in SWEEP:
            buffer = torch.ones(size // 4)
            for _ in range(3):
                dist.barrier()  # ranks meet here: both start the all-reduce together
                start = time.perf_counter()
                dist.all_reduce(buffer)  # ranks meet here
                sweep[size].append(time.perf_counter() - start)
        for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            dist.barrier()  # ranks meet here: no rank starts a block while its peer finishes the last
            for _ in range(per_round):
                timeline = runs[key][0].enable_timeline() if key[1] == "no_comm" else None
                times[key].append(_timed_step(*runs[key], timeline))
                if timeline is not None:
                    profiles[key[0]].append(timeline.snapshot())
        _say(f"  round {r + 1}/{rounds} done, {time.perf_counter() - start:.0f} s")
    steps = {name: {str(cap): statistics.median(times[name, cap]) for cap in CAPS} for name in loads}
    return steps, {size: statistics.median(t[1:]) for size, t in sweep.items()}, profiles


def _world1_profiles(loads, steps=9):
    """Timelines of `steps` steps per workload on a single rank (no peer, no communication)."""
    profiles = {}
    for name, (load, x, y) in loads.items():
        _say(f"  {name}: {steps} steps on one rank")
        model = minidp.DDP(load.build(seed=0))
        opt = workloads.make_optimizer(model)
        for _ in range(3):
            _timed_step(model, opt, x, y)
        profiles[name] = []
        for _ in range(steps):
            timeline = model.enable_timeline()
            _timed_step(model, opt, x, y, timeline)
            profiles[name].append(timeline.snapshot())
    return profiles


def _say(text: str) -> None:
    """A progress line from rank 0 (the run is minutes long; the others say nothing)."""
    if dist.get_rank() == 0:
        print(text, flush=True)


def _worker(local_rank, out_dir):
    torch.set_num_threads(1)
    env = minidp.init(backend="gloo", timeout=300)
    loads, result = {}, {"params": {}}
    for name in NAMES:
        load = workloads.get(name)
        x, y = load.batch_for(env.rank, torch.device("cpu"))
        loads[name] = (load, x, y)
        result["params"][name] = {n: p.numel() * p.element_size() for n, p in load.build(seed=0).named_parameters()}
    if env.world_size > 1:
        result["measured"], result["sweep"], result["profiles"] = _measure(loads)
    else:
        result["profiles"] = _world1_profiles(loads)
    if env.rank == 0:
        torch.save(result, os.path.join(out_dir, f"world{env.world_size}.pt"))
    minidp.shutdown()


def _run(world_size):
    with tempfile.TemporaryDirectory() as tmp, heartbeat(f"{world_size} rank(s) running"):
        minidp.launch(_worker, nprocs=world_size, args=(tmp,), timeout=1200)
        return torch.load(os.path.join(tmp, f"world{world_size}.pt"), weights_only=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # --help must not start a 4-minute run
    p.add_argument("--from-json", metavar="FILE", help="re-print the tables and redraw the plot of a recorded run")
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for the JSON and the plot (default: runs/simulator/)")
    p.add_argument("--record", action="store_true", help=f"write them into {os.path.relpath(RECORDED)}/ instead: "
                   "the recorded run that RESULTS.md shows")
    args = p.parse_args(argv)
    out = RECORDED if args.record else args.out
    try:
        check_writable("--out", out, folder=True)  # before minutes of ranks, not after
    except ValueError as e:
        p.exit(2, f"{p.prog}: error: {e}\n")
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        return _publish(report, out)
    print("1/2 at world size 2: compute profiles, then steps per cap and the all-reduce sweep, in rounds", flush=True)
    world2 = _run(2)
    print("2/2 compute profiles at world size 1", flush=True)
    world1 = _run(1)
    sweep = world2["sweep"]
    link = fit_ring(sweep, 2)
    net = Network(link, Link(link.latency_s, link.bandwidth), ranks_per_node=2, shared_cores=True)
    report = {"sweep": {str(k): v for k, v in sweep.items()}, "network": net.to_dict(), "workloads": {}}
    for name in NAMES:
        measured = {cap: world2["measured"][name][str(cap)] for cap in CAPS}
        entry = {"measured_ms": {str(k): 1e3 * v for k, v in measured.items()}}
        for source, data in (("no_comm_world2", world2), ("world1", world1)):
            profile = Profile.median([Profile.from_events(events, data["params"][name])
                                      for events in data["profiles"][name]])
            predicted = {cap: simulate_step(profile, net, 2, cap)["step_s"] for cap in CAPS}
            overlapped = Network(link, link, 2, shared_cores=False)
            entry[source] = {
                "compute_ms": 1e3 * profile.compute_s,
                "predicted_ms": {str(k): 1e3 * v for k, v in predicted.items()},
                "error": {str(k): predicted[k] / measured[k] - 1 for k in CAPS},
                "predicted_if_overlapped_ms": 1e3 * simulate_step(profile, overlapped, 2)["step_s"],
                "best_cap_predicted": str(best_cap(profile, net, 2, CAPS[1:])[0]),
            }
            if name == "resnet18" and source == "no_comm_world2":
                entry["cluster_scaling"] = scaling(profile, CLUSTER)
        entry["best_cap_measured"] = str(min(CAPS[1:], key=lambda c: measured[c]))
        report["workloads"][name] = entry
    with open(os.path.join(out, "simulate_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {os.path.join(out, 'simulate_check.json')}")
    return _publish(report, out)


def _publish(report: dict, out: str) -> int:
    """Print the tables for RESULTS.md; draw the ResNet-18 prediction on the default cluster network."""
    from minidp.study.plot import plot_scaling

    print(markdown(report))
    rows = report["workloads"]["resnet18"]["cluster_scaling"]
    png = os.path.join(out, "simulate_resnet18_cluster.png")
    plot_scaling(png, rows, "ResNet-18 32x32, batch 32 per rank (compute measured here), on network.CLUSTER, ring")
    print(f"wrote {png}")
    return 0


def markdown(report: dict) -> str:
    """The tables for RESULTS.md."""
    from minidp.study.network import allreduce_time

    net = report["network"]["intra"]
    lines = [f"Fitted gloo ring link (2 processes, this machine): latency {1e6 * net['latency_s']:.0f} us, "
             f"bandwidth {net['bandwidth'] / 1e9:.2f} GB/s.", "",
             "| size | measured ms | fitted ms |", "| --- | --- | --- |"]
    link = Link(**report["network"]["intra"])
    fitted = Network(link, link, 2)
    for size, t in report["sweep"].items():
        lines.append(f"| {int(size) // 1024} KiB | {1e3 * t:.3f} | {1e3 * allreduce_time(int(size), 2, fitted):.3f} |")
    lines += ["", "| workload | profile | cap | measured ms | predicted ms | error |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, entry in report["workloads"].items():
        for source in ("no_comm_world2", "world1"):
            for cap, m in entry["measured_ms"].items():
                p = entry[source]["predicted_ms"][cap]
                lines.append(f"| {name} | {source} | {cap} | {m:.1f} | {p:.1f} | {100 * (p / m - 1):+.0f}% |")
        lines.append(f"| {name} | best cap | | {entry['best_cap_measured']} | "
                     f"{entry['no_comm_world2']['best_cap_predicted']} / {entry['world1']['best_cap_predicted']} | |")
    from minidp.study.simulate import format_table

    lines += ["", "ResNet-18 on network.CLUSTER (8 ranks per node; 5 us, 100 GB/s inside; 15 us, 12.5 GB/s between):",
              "```", format_table(report["workloads"]["resnet18"]["cluster_scaling"], CLUSTER), "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
