"""A recorder of what happens inside one step: gradients ready, buckets launched and completed.

Off by default: the reducer checks `timeline is not None` and does nothing else.
Turn it on with `model.enable_timeline()`; each event is (kind, time_ns, fields), time from
time.perf_counter_ns() (CLOCK_MONOTONIC on Linux: one clock for every process on a machine).

Kinds the reducer records: "grad_ready" (param, bucket), "launch" (bucket), "done" (bucket, from
the thread that completes the communication), "backward_end", "finalize_end". A training loop may
add its own with `record()`: "forward_start", "backward_start" and "step_end" are drawn too.

Example:
    timeline = model.enable_timeline()
    timeline.record("forward_start")
    loss = loss_fn(model(x), y)
    timeline.record("backward_start")
    loss.backward()
    opt.step()
    timeline.record("step_end")
    timeline.to_chrome_trace("step.json")   # open in https://ui.perfetto.dev
    # a PNG of the same lanes: benchmarks/plot_timeline.py (matplotlib stays out of the engine)
"""
from __future__ import annotations

import json
import threading
import time

# Spans of the "step" lane: (name, start kind, end kind); drawn when both events exist.
STEP_SPANS = (("forward", "forward_start", "backward_start"), ("backward", "backward_start", "backward_end"),
              ("finalize (wait + write back)", "backward_end", "finalize_end"),
              ("optimizer", "finalize_end", "step_end"))
STEP_TID, GRADS_TID, BUCKET_TID0 = 0, 1, 10


class Timeline:
    """Thread-safe list of events; communication completions are recorded from comm threads."""

    def __init__(self, events=None):
        self.events: list[tuple[str, int, dict]] = list(events or [])
        self._lock = threading.Lock()

    def record(self, kind: str, **fields) -> None:
        stamp = time.perf_counter_ns()
        with self._lock:
            self.events.append((kind, stamp, fields))

    def watch(self, future, **fields) -> None:
        """Record a "done" event when `future` completes (called on the thread that completes it)."""
        future.add_done_callback(lambda _: self.record("done", **fields))

    def snapshot(self) -> list[tuple[str, int, dict]]:
        """A copy of the events sorted by time (comm threads may append slightly out of order)."""
        with self._lock:
            return sorted(self.events, key=lambda e: e[1])

    def bucket_spans(self) -> list[dict]:
        """Per launch of a bucket: its gradients' first/last ready time, launch and done (ns)."""
        return bucket_spans(self.snapshot())

    def to_chrome_trace(self, path: str, pid: int = 0) -> None:
        """Write a Chrome/Perfetto trace (JSON) of the recorded events; `pid` is shown as the rank."""
        write_chrome_trace(path, {pid: self.snapshot()})


def bucket_spans(events) -> list[dict]:
    """Pair each bucket's k-th "launch" with its k-th "done" and the gradients that came before.

    Returns dicts (bucket, params, first_ready, last_ready, launch, done), in launch order; times in
    ns, None where an event is missing (e.g. a bucket still in flight).
    """
    spans, pending, dones = [], {}, {}
    for kind, stamp, fields in sorted(events, key=lambda e: e[1]):
        if kind == "grad_ready":
            pending.setdefault(fields["bucket"], []).append(stamp)
        elif kind == "launch":
            ready = pending.pop(fields["bucket"], [])
            spans.append({"bucket": fields["bucket"], "params": len(ready), "first_ready": min(ready, default=None),
                          "last_ready": max(ready, default=None), "launch": stamp, "done": None})
        elif kind == "done":
            dones.setdefault(fields["bucket"], []).append(stamp)
    for span in spans:  # k-th launch of a bucket <-> its k-th completion
        queue = dones.get(span["bucket"], [])
        span["done"] = queue.pop(0) if queue else None
    return spans


def step_spans(events):
    """(name, start, end) of the step phases present in `events` (first occurrence of each kind)."""
    first = {}
    for kind, stamp, _ in sorted(events, key=lambda e: e[1]):
        first.setdefault(kind, stamp)
    if "backward_start" not in first and "grad_ready" in first:
        first["backward_start"] = first["grad_ready"]  # no marker from the loop: backward began by then
    return [(name, first[a], first[b]) for name, a, b in STEP_SPANS if a in first and b in first]


def trace_events(events, pid: int = 0, t0_ns: int | None = None) -> list[dict]:
    """Chrome trace events: "X" spans (ts/dur in microseconds) per lane, "i" marks per gradient."""
    t0 = min((e[1] for e in events), default=0) if t0_ns is None else t0_ns
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731 - a one-line unit conversion
    out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": STEP_TID, "args": {"name": "step"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": GRADS_TID, "args": {"name": "gradients ready"}}]
    for name, start, end in step_spans(events):
        out.append({"ph": "X", "name": name, "pid": pid, "tid": STEP_TID, "ts": us(start), "dur": us(end) - us(start)})
    for kind, stamp, fields in events:
        if kind == "grad_ready":
            out.append({"ph": "i", "s": "t", "name": fields.get("param", "grad"), "pid": pid, "tid": GRADS_TID,
                        "ts": us(stamp), "args": {"bucket": fields.get("bucket")}})
    for span in bucket_spans(events):
        tid = BUCKET_TID0 + span["bucket"]
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": f"bucket {span['bucket']}"}})
        if span["done"] is not None:
            out.append({"ph": "X", "name": f"all-reduce bucket {span['bucket']}", "pid": pid, "tid": tid,
                        "ts": us(span["launch"]), "dur": us(span["done"]) - us(span["launch"]),
                        "args": {"params": span["params"],
                                 "launch_after_last_ready_us": _gap_us(span["last_ready"], span["launch"])}})
    return out


def _gap_us(a, b):
    return None if a is None or b is None else (b - a) / 1e3


def write_chrome_trace(path: str, events_by_rank: dict) -> None:
    """One trace file for several ranks (pid = rank), on a common time origin."""
    t0 = min((e[1] for events in events_by_rank.values() for e in events), default=0)
    merged = [ev for rank, events in events_by_rank.items() for ev in trace_events(events, rank, t0)]
    with open(path, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
