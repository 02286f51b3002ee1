"""A recorder of what happens inside one step: gradients ready, buckets launched and completed.

Off by default: the reducer calls a recorder whose methods do nothing (progress.py), never `if
timeline`. Turn it on with `model.enable_timeline()`, which gives the reducer a `ReducerRecorder` over a
Timeline; each event is (kind, time_ns, fields), time from time.perf_counter_ns() (CLOCK_MONOTONIC
on Linux: one clock for every process on a machine).

Kinds the reducer records: "grad_ready" (param, bucket), "launch" (bucket), "done" (bucket, from
the thread that completes the communication), "backward_end", "finalize_end". A training loop may
add its own with `record()`: "forward_start", "backward_start" and "step_end" are drawn too, and so
are spans of any lane: "begin" and "end" with the same lane= and name= (ZeRO's step inside
backward records its steps and broadcasts so, minidp/sharded/zero/overlap.py).

On CUDA, "done" is when the host saw the future complete, and an NCCL future completes when the
all-reduce is *enqueued*: its launch -> done span says nothing about the GPU. So watch(device=...)
also records CUDA events: one on the current stream at launch, before the work is queued (the
bucket's inputs are ready there; recorded after, it would follow work a transport queues on the
current stream, and the span would shrink to nothing), one on the stream the future's callback runs
on (it waits for the collective's result).
snapshot() turns them into "gpu_start"/"gpu_end" events on the host clock, with one device sync,
anchored at an event the host waited for. The GPU span includes waiting behind earlier buckets on
the communication stream.

Example:
    timeline = model.enable_timeline()
    timeline.record("forward_start")
    loss = loss_fn(model(x), y)
    timeline.record("backward_start")
    loss.backward()
    opt.step()
    timeline.record("step_end")
    timeline.to_chrome_trace("step.json")   # open in https://ui.perfetto.dev
    # a PNG of the same lanes: benchmarks/overlap/plot_timeline.py (matplotlib stays out of the engine)
"""
from __future__ import annotations

import json
import threading
import time

import torch

from .progress import RecorderOff

# Spans of the "step" lane: (name, start kind, end kind); drawn when both events exist.
STEP_SPANS = (("forward", "forward_start", "backward_start"), ("backward", "backward_start", "backward_end"),
              ("finalize (wait + write back)", "backward_end", "finalize_end"),
              ("optimizer", "finalize_end", "step_end"))
STEP_TID, GRADS_TID, BUCKET_TID0, GPU_TID0, LANE_TID0 = 0, 1, 10, 10_000, 20_000
HOST_LANE, GPU_LANE = "host: launch -> future done", "GPU time of the collective"


class Timeline:
    """Thread-safe list of events; communication completions are recorded from comm threads."""

    def __init__(self, events=None):
        self.events: list[tuple[str, int, dict]] = list(events or [])
        self._lock = threading.Lock()
        self._gpu_pending: list[list] = []  # [device, fields, start event, end event or None]

    def record(self, kind: str, **fields) -> None:
        stamp = time.perf_counter_ns()
        with self._lock:
            self.events.append((kind, stamp, fields))

    def watch(self, future, device=None, start=None, **fields) -> None:
        """Record a "done" event when `future` completes (called on the thread that completes it).

        Args:
            future: the communication's future, e.g. a bucket's.
            device: the device of the tensors it communicates. On CUDA the GPU time of the work is
                recorded too (see the module's docstring). Default None: the host event only.
            start: on CUDA, the timing event recorded before the work was queued (gpu_start_event()).
                Default None: one recorded now on the current stream (right only for work queued on
                another stream).
            fields: stored with the events, e.g. bucket=3.
        """
        if device is None or torch.device(device).type != "cuda":
            future.add_done_callback(lambda _: self.record("done", **fields))
            return
        start = start if start is not None else gpu_start_event(device)
        pending = [device, fields, start, None]
        with self._lock:
            self._gpu_pending.append(pending)

        def done(_):
            end = torch.cuda.Event(enable_timing=True)
            # Inside a CUDA future's callback the current stream waits for the future's work.
            end.record(torch.cuda.current_stream(device))
            pending[3] = end
            self.record("done", **fields)

        future.add_done_callback(done)

    def snapshot(self) -> list[tuple[str, int, dict]]:
        """A copy of the events sorted by time (comm threads may append slightly out of order).

        Converts the CUDA events recorded so far (waiting for the device once, if there are any).
        """
        self._convert_gpu_events()
        with self._lock:
            return sorted(self.events, key=lambda e: e[1])

    def _convert_gpu_events(self) -> None:
        with self._lock:
            ready = [p for p in self._gpu_pending if p[3] is not None]
            self._gpu_pending = [p for p in self._gpu_pending if p[3] is None]
        anchors, converted = {}, []
        for device, fields, start, end in ready:
            key = torch.device(device)
            if key not in anchors:
                anchors[key] = _host_anchor(key)
            anchor, anchor_ns = anchors[key]
            for kind, event in (("gpu_start", start), ("gpu_end", end)):
                # elapsed_time: milliseconds from `event` to the anchor, on the GPU's clock.
                converted.append((kind, anchor_ns - round(event.elapsed_time(anchor) * 1e6), fields))
        with self._lock:
            self.events.extend(converted)

    def bucket_spans(self) -> list[dict]:
        """Per launch of a bucket: its gradients' first/last ready time, launch and done (ns)."""
        return bucket_spans(self.snapshot())

    def to_chrome_trace(self, path: str, pid: int = 0) -> None:
        """Write a Chrome/Perfetto trace (JSON) of the recorded events; `pid` is shown as the rank."""
        write_chrome_trace(path, {pid: self.snapshot()})


class ReducerRecorder(RecorderOff):
    """The reducer's events into `timeline` (progress.py lists them).

    Args:
        timeline: where the events go.
        device: the reducer's device (on CUDA the GPU's start and end of each bucket are recorded).
    """

    def __init__(self, timeline: Timeline, device: torch.device):
        self.timeline, self.device = timeline, device
        self._starts = {}  # bucket -> CUDA start event recorded at launch, until watch() takes it

    def grad_ready(self, name: str, bucket: int) -> None:
        self.timeline.record("grad_ready", param=name, bucket=bucket)

    def launch(self, iteration: int, bucket: int) -> None:
        """Called before the bucket's work is queued: the host time, and on CUDA the GPU's start."""
        self.timeline.record("launch", bucket=bucket)
        if self.device.type == "cuda":
            self._starts[bucket] = gpu_start_event(self.device)

    def watch(self, bucket: int, future) -> None:
        start = self._starts.pop(bucket, None)
        self.timeline.watch(future, device=self.device, start=start, bucket=bucket)

    def event(self, kind: str, iteration: int) -> None:
        """"backward_end", "finalize_end", "failed_iteration_closed"."""
        self.timeline.record(kind)


def gpu_start_event(device) -> torch.cuda.Event:
    """A timing event on `device`'s current stream, recorded now: after what produced the inputs."""
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    return start


def _host_anchor(device: torch.device):
    """A CUDA event on `device` and the host time (perf_counter_ns) at which the GPU passed it.

    The device is idle first, so the event is passed as soon as it is recorded: the host time is
    the middle of record .. synchronize returned, off by at most half of that round trip (~10 us).
    """
    torch.cuda.synchronize(device)  # every event recorded so far is complete after this
    anchor = torch.cuda.Event(enable_timing=True)
    before = time.perf_counter_ns()
    anchor.record(torch.cuda.current_stream(device))
    anchor.synchronize()
    return anchor, (before + time.perf_counter_ns()) // 2


def bucket_spans(events) -> list[dict]:
    """Pair each bucket's k-th "launch" with its k-th "done" (and GPU span) and the gradients before it.

    Returns dicts (bucket, params, first_ready, last_ready, launch, done, gpu_start, gpu_end), in
    launch order; times in ns, None where an event is missing (a bucket still in flight; no GPU).
    """
    spans, pending, later = [], {}, {"done": {}, "gpu_start": {}, "gpu_end": {}}
    for kind, stamp, fields in sorted(events, key=lambda e: e[1]):
        if kind == "grad_ready":
            pending.setdefault(fields["bucket"], []).append(stamp)
        elif kind == "launch":
            ready = pending.pop(fields["bucket"], [])
            spans.append({"bucket": fields["bucket"], "params": len(ready), "first_ready": min(ready, default=None),
                          "last_ready": max(ready, default=None), "launch": stamp, "done": None,
                          "gpu_start": None, "gpu_end": None})
        elif kind in later:
            later[kind].setdefault(fields["bucket"], []).append(stamp)
    for span in spans:  # k-th launch of a bucket <-> its k-th completion (and k-th GPU span)
        for kind, by_bucket in later.items():
            queue = by_bucket.get(span["bucket"], [])
            span[kind] = queue.pop(0) if queue else None
    return spans


def step_spans(events):
    """(name, start, end) of the step phases present in `events` (first occurrence of each kind)."""
    first = {}
    for kind, stamp, _ in sorted(events, key=lambda e: e[1]):
        first.setdefault(kind, stamp)
    if "backward_start" not in first and "grad_ready" in first:
        first["backward_start"] = first["grad_ready"]  # no marker from the loop: backward began by then
    return [(name, first[a], first[b]) for name, a, b in STEP_SPANS if a in first and b in first]


def named_spans(events) -> list[tuple[str, str, int, int]]:
    """(lane, name, start, end) of each "begin" paired with the next "end" of the same lane and name."""
    open_spans, spans = {}, []
    for kind, stamp, fields in sorted(events, key=lambda e: e[1]):
        key = (fields.get("lane", ""), fields.get("name", ""))
        if kind == "begin":
            open_spans.setdefault(key, []).append(stamp)
        elif kind == "end" and open_spans.get(key):
            spans.append((*key, open_spans[key].pop(0), stamp))
    return spans


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
        out += _bucket_lanes(span, pid, us)
    lanes: dict[str, int] = {}
    for lane, name, start, end in named_spans(events):
        if lane not in lanes:
            lanes[lane] = LANE_TID0 + len(lanes)
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lanes[lane], "args": {"name": lane}})
        out.append({"ph": "X", "name": name, "pid": pid, "tid": lanes[lane], "ts": us(start),
                    "dur": us(end) - us(start)})
    return out


def _bucket_lanes(span: dict, pid: int, us) -> list[dict]:
    """Trace events of one bucket launch: the host's lane, and on CUDA the GPU's lane."""
    b, tid, gpu_tid = span["bucket"], BUCKET_TID0 + span["bucket"], GPU_TID0 + span["bucket"]
    out = [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"bucket {b}: {HOST_LANE}"}}]
    if span["done"] is not None:
        out.append({"ph": "X", "name": f"all-reduce bucket {b}", "pid": pid, "tid": tid,
                    "ts": us(span["launch"]), "dur": us(span["done"]) - us(span["launch"]),
                    "args": {"lane": HOST_LANE, "params": span["params"],
                             "launch_after_last_ready_us": _gap_us(span["last_ready"], span["launch"])}})
    if span["gpu_start"] is not None and span["gpu_end"] is not None:
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": gpu_tid,
                    "args": {"name": f"bucket {b}: {GPU_LANE}"}})
        out.append({"ph": "X", "name": f"all-reduce bucket {b} (GPU)", "pid": pid, "tid": gpu_tid,
                    "ts": us(span["gpu_start"]), "dur": us(span["gpu_end"]) - us(span["gpu_start"]),
                    "args": {"lane": GPU_LANE + " (inputs ready -> result ready, queueing included)"}})
    return out


def _gap_us(a, b):
    return None if a is None or b is None else (b - a) / 1e3


def write_chrome_trace(path: str, events_by_rank: dict) -> None:
    """One trace file for several ranks (pid = rank), on a common time origin."""
    t0 = min((e[1] for events in events_by_rank.values() for e in events), default=0)
    merged = [ev for rank, events in events_by_rank.items() for ev in trace_events(events, rank, t0)]
    with open(path, "w") as f:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
