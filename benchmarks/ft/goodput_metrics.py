"""Goodput and recovery times from a run's event logs (benchmarks/ft/event_log.py's format).

    runs = read_logs(log_dir)                     # one entry per process incarnation
    rate = committed_rate(runs, run_start, 60.0)  # distinct committed step indices per second
    summary = summarize(runs, schedule, run_start, 60.0, baseline_rate=free_rate)

The measures, all over the run's window [run_start, run_start + duration_s]:
  committed steps/s   distinct step indices committed in the window / duration_s (a step redone
                      after a restart counts once: its index repeats)
  goodput             that rate / the failure-free run's rate (same mode, same duration)
  replica-steps/s     distinct (step index, replica) pairs committed in the window / duration_s:
                      the batches that went into committed steps (a step of 2 live replicas of 3
                      counts 2/3 of a full one); its goodput likewise
  kill -> commit      for each scheduled kill, from when it fired (its "failure" event; else
                      run_start + at_s), the time to the first commit by ANY replica after it
                      (a straggler finishing a step committed before the kill excepted: see
                      kill_to_commit)
  restart -> commit   for each process start of a replica after its first, the time to that
                      incarnation's first commit
A time with no commit before the window ends is counted in `missing`, not in the spread.
"""
from __future__ import annotations

import bisect
import glob
import json
import os
from typing import Dict, Iterable, List, Optional

FEW = 10  # below this many samples the spread is min-max, not p10-p90


def read_logs(log_dir: str) -> List[dict]:
    """Every incarnation's events: [{"replica", "start", "commits": [(t, step)], "failures": [(t, kind, at_s)],
    "path"}], by start.

    Args:
        log_dir: the folder of *.jsonl event files (other files there are ignored).

    Raises:
        ValueError: a line that is not an event (the file and line are named).
    """
    if not os.path.isdir(log_dir):
        raise ValueError(f"log_dir={log_dir!r} is not a folder")
    runs = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*.jsonl"))):
        start, replica, commits, failures = None, None, [], []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    e = json.loads(line)
                    t, replica, kind = float(e["t"]), int(e["replica"]), e["event"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: {line.strip()!r} is not an event ({exc})") from exc
                if kind == "start":
                    start = t if start is None else min(start, t)
                elif kind == "commit":
                    commits.append((t, int(e["step"])))
                elif kind == "failure":
                    failures.append((t, e["kind"], float(e["at_s"])))
        if replica is None:
            continue  # an empty file: the process died before its first write
        commits.sort()
        if start is None:
            start = commits[0][0]
        runs.append({"replica": replica, "start": start, "commits": commits, "failures": failures, "path": path})
    runs.sort(key=lambda r: r["start"])
    return runs


def committed_rate(runs: List[dict], run_start: float, duration_s: float, per_replica: bool = False) -> float:
    """Distinct step indices committed within [run_start, run_start + duration_s], per second.

    Args:
        per_replica: count distinct (step, replica) pairs instead: replica-steps, each a replica's
            batch (a step committed by fewer live replicas counts less). Default False.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s={duration_s!r} must be > 0")
    end = run_start + duration_s
    steps = {(s, r["replica"]) if per_replica else s for r in runs for t, s in r["commits"] if run_start <= t <= end}
    return len(steps) / duration_s


def fired_failures(runs: List[dict]) -> Dict[tuple, float]:
    """{(replica, at_s): the time it fired} from the logs' "failure" events (the first, if logged twice)."""
    fired = {}
    for r in runs:
        for t, _, at_s in r.get("failures", ()):
            key = (r["replica"], at_s)
            fired[key] = min(t, fired.get(key, t))
    return fired


def kill_to_commit(runs: List[dict], schedule: Iterable[dict], run_start: float, end: float,
                   kinds=("kill",)) -> List[Optional[float]]:
    """For each scheduled event of `kinds` before `end`: seconds to the next commit by any replica (None: none).

    The clock starts when the event fired, where the logs say so ("failure" events); in logs
    without any, at run_start + at_s. In logs with them, an event that never fired (its replica's
    process started after its time, or was stuck before its next mid-step poll until the end) is
    not a failure and is left out.
    A straggler's commit is not the next one: a process that was running at the failure may still
    commit a step that another replica had committed before it (its all-reduce was done, its
    optimizer step was not); such a commit (an index at most the highest committed before the
    failure, by a process started before it) finishes work from before the failure and is skipped.
    A restarted process's first commit counts even when it redoes an earlier index.

    Args:
        schedule: make_schedule's events ({"at_s", "replica", "kind"}).
        run_start, end: the window, time.time() seconds.
        kinds: which event kinds to measure. Default ("kill",).
    """
    commits = sorted((t, s, r["start"]) for r in runs for t, s in r["commits"] if t <= end)
    times = [c[0] for c in commits]
    fired = fired_failures(runs)
    out = []
    for e in sorted(schedule, key=lambda e: e["at_s"]):
        at = fired.get((e["replica"], e["at_s"]), None if fired else run_start + e["at_s"])
        if e["kind"] not in kinds or at is None or at >= end:
            continue
        i = bisect.bisect_right(times, at)
        done = max((s for _, s, _ in commits[:i]), default=-1)
        nxt = next((t for t, s, born in commits[i:] if s > done or born > at), None)
        out.append(None if nxt is None else nxt - at)
    return out


def restart_to_commit(runs: List[dict], run_start: float, end: float) -> List[Optional[float]]:
    """For each incarnation of a replica after its first that started in the window: seconds to its first commit."""
    out, seen = [], set()
    for r in sorted(runs, key=lambda r: r["start"]):
        if r["replica"] not in seen:
            seen.add(r["replica"])
            continue
        if not run_start <= r["start"] < end:
            continue
        first = [t for t, _ in r["commits"] if t <= end]
        out.append(first[0] - r["start"] if first else None)
    return out


def _quantile(xs: List[float], q: float) -> float:
    """The q-quantile of sorted xs, interpolated linearly (numpy's default)."""
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Iterable[Optional[float]]) -> Dict[str, object]:
    """Median and spread of the values that are not None: p10-p90 from FEW samples on, else min-max.

    Returns:
        {"n", "missing" (the Nones), "median", "lo", "hi", "range": "p10-p90" | "min-max"};
        median/lo/hi are None when there is no value.
    """
    values = list(values)
    xs = sorted(v for v in values if v is not None)
    out = {"n": len(xs), "missing": len(values) - len(xs), "median": None, "lo": None, "hi": None,
           "range": "p10-p90" if len(xs) >= FEW else "min-max"}
    if xs:
        out["median"] = _quantile(xs, 0.5)
        out["lo"], out["hi"] = (_quantile(xs, 0.1), _quantile(xs, 0.9)) if len(xs) >= FEW else (xs[0], xs[-1])
    return out


def summarize(runs: List[dict], schedule: Iterable[dict], run_start: float, duration_s: float,
              baseline_rate: Optional[float] = None) -> Dict[str, object]:
    """One run's measures: rate, goodput (with a baseline), and the raw recovery times.

    Args:
        runs: read_logs' list.
        schedule: the failure schedule the run met ([] for a failure-free run).
        run_start, duration_s: the window.
        baseline_rate: the failure-free run's committed steps/s. Default None: no goodput (the
            replica-step goodput is the caller's: this rate over the baseline's).
    """
    end = run_start + duration_s
    rate = committed_rate(runs, run_start, duration_s)
    replica_rate = committed_rate(runs, run_start, duration_s, per_replica=True)
    schedule = list(schedule)
    return {
        "committed_steps_per_s": rate,
        "goodput": rate / baseline_rate if baseline_rate else None,
        "committed_replica_steps_per_s": replica_rate,
        "incarnations": len(runs),
        "failures_scheduled": sum(1 for e in schedule if e["at_s"] < duration_s),
        "failures_fired": len(fired_failures(runs)),
        "kill_to_commit_s": kill_to_commit(runs, schedule, run_start, end),
        "failure_to_commit_s": kill_to_commit(runs, schedule, run_start, end, kinds=("kill", "exception", "hang")),
        "restart_to_commit_s": restart_to_commit(runs, run_start, end),
    }
