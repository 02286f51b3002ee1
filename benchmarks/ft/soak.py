"""The soak: hundreds of failures of all three kinds in one minidp.ft run, and nothing lost.

    python benchmarks/ft/soak.py                       # 4 replicas, 500 failures scheduled, ~17 min
    python benchmarks/ft/soak.py --failures 20 --gap 2 # a short one

One `python -m minidp.run --ft` run of benchmarks/ft/minidp_worker.py (the goodput benchmark's
workload) meets a random schedule (workload.make_schedule: exception, kill, hang in turn, on random
replicas, at least --gap seconds apart). An event whose replica is down at its time cannot fire;
the schedule is longer than --least so that at least that many do (about half fire here: a replica
restarting after a kill takes seconds, torch's import, and one hung sleeps --hang-s). Every replica records its rounds
(minidp.ft.Replica(record=...)); afterwards minidp.ft.replay replays the recorded membership in one
process with no failure machinery. Nothing lost means: every step committed once with one set of
participants (no fork), steps 0 ... n-1 without a gap, every participant's digest after every commit
equal to the replay's, and the run never restarted as a whole (only single replicas restarted).
Prints the counts and the recovery figures; --json writes them (nothing is written by default).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import goodput_metrics as gm  # noqa: E402
import minidp_side  # noqa: E402
import minidp_worker  # noqa: E402
from workload import make_schedule  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--failures", type=int, default=500, help="events scheduled (default 500)")
    p.add_argument("--least", type=int, default=200, help="fired failures the soak must reach (default 200)")
    p.add_argument("--gap", type=float, default=2.0, help="least seconds between two events (default 2)")
    p.add_argument("--width", type=int, default=256,
                   help="the workload MLP's width (default 256: 0.33 M parameters, a light load on 2 cores)")
    p.add_argument("--hang-s", type=float, default=6.0)
    p.add_argument("--timeout", type=float, default=3.0, help="collectives and transfers between replicas")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summary here (default: nowhere)")
    p.add_argument("--keep", default=None, help="keep the logs and the record in this folder (default: a temp one)")
    a = p.parse_args(argv)
    for name in ("replicas", "failures", "least"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)} must be >= 1")
    if a.gap <= 0:
        p.error(f"--gap {a.gap} must be > 0")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    duration = 8.0 + a.failures * a.gap + 10.0
    schedule = make_schedule(a.failures, duration - 10.0, a.replicas, seed=a.seed, start_s=8.0, gap_s=a.gap)
    duration = max(duration, schedule[-1]["at_s"] + 10.0)
    print(f"soak: {a.replicas} replicas, {len(schedule)} failures scheduled over {duration:.0f} s "
          f"(gap {a.gap} s, hang {a.hang_s} s, timeout {a.timeout} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="ft-soak-") as tmp:
        tmp = a.keep or tmp
        logs, record = os.path.join(tmp, "logs"), os.path.join(tmp, "record")
        os.makedirs(record, exist_ok=True)
        start = time.time() + 1.0
        minidp_side.run(schedule, duration, a.replicas, logs, start, hang_s=a.hang_s, hang_timeout=a.timeout,
                        record=record, width=a.width)
        summary = summarize(logs, record, schedule, start, duration, a.width)
    for key, value in summary.items():
        print(f"  {key}: {value}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), **summary}, f, indent=1)
    ok = summary["nothing_lost"] and summary["failures_fired"] >= a.least and not summary["whole_run_restarts"]
    print("soak: PASS" if ok else "soak: FAIL", flush=True)
    return 0 if ok else 1


def summarize(logs, record, schedule, start, duration, width) -> dict:
    import torch

    from minidp.ft.replay import check_run
    torch.set_num_threads(1)  # as the replicas compute: a matmul's sums depend on the thread count
    runs = gm.read_logs(logs)
    fired = gm.fired_failures(runs)
    kinds = collections.Counter()
    for e in schedule:
        if (e["replica"], e["at_s"]) in fired:
            kinds[e["kind"]] += 1
    t0 = time.monotonic()
    report = check_run(record, lambda: minidp_worker.build(width), minidp_worker.body)
    replay_s = time.monotonic() - t0
    entries = _entries(record)
    heals = [e for e in entries if e.get("heal") and e["committed"] > 0]
    discarded = {e["round"] for e in entries if not e.get("heal") and not e["committed"]}
    with open(os.path.join(logs, "launcher.log"), errors="replace") as f:
        launcher = f.read()
    end = start + duration
    return {
        "failures_scheduled": len(schedule), "failures_fired": len(fired), "fired_by_kind": dict(kinds),
        "steps_committed": report["steps"], "commits_checked": report["commits"],
        "mismatches": len(report["mismatches"]), "nothing_lost": not report["mismatches"],
        "rounds_discarded": len(discarded), "replica_restarts": launcher.count("restarting replica"),
        "whole_run_restarts": launcher.count("restarting all"),
        "heals": len(heals), "heal_transfer_s": _spread([h["seconds"] for h in heals]),
        # what the others wait for when a joiner comes back: their quorum wait in its first round
        "peers_wait_at_a_join_s": _spread(_waits_at_joins(entries)),
        "quorum_wait_s": _spread([e["waited_s"] for e in entries if not e.get("heal") and e["committed"]]),
        "kill_to_commit_s": _spread(gm.kill_to_commit(runs, schedule, start, end)),
        "failure_to_commit_s": _spread(gm.kill_to_commit(runs, schedule, start, end,
                                                         kinds=("kill", "exception", "hang"))),
        "restart_to_commit_s": _spread(gm.restart_to_commit(runs, start, end)),
        "replay_s": round(replay_s, 1),
    }


def _waits_at_joins(entries):
    """The quorum waits of a joiner's peers in the first round it takes part in after a heal."""
    rounds = {}
    for e in entries:
        if not e.get("heal"):
            rounds.setdefault(e["round"], []).append(e)
    waits = []
    for h in (e for e in entries if e.get("heal") and e["committed"] > 0):
        joined = [r for r, es in rounds.items() if r > h["round"] and h["replica"] in es[0]["participants"]]
        if joined:
            waits += [e["waited_s"] for e in rounds[min(joined)] if e["replica"] != h["replica"]]
    return waits


def _entries(record):
    """Every recorded entry of every replica, with its replica id."""
    out = []
    for name in sorted(os.listdir(record)):
        replica = int(name[len("replica"):-len(".jsonl")])
        with open(os.path.join(record, name)) as f:
            out += [{"replica": replica, **json.loads(line)} for line in f]
    return out


def _spread(values):
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return "none"
    q = statistics.quantiles(xs, n=10) if len(xs) >= 10 else [xs[0]] * 8 + [xs[-1]]
    return f"median {statistics.median(xs):.2f} [p10 {q[0]:.2f} - p90 {q[-1]:.2f}] n={len(xs)}"


if __name__ == "__main__":
    sys.exit(main())
