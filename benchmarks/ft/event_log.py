"""The event log every fault-tolerance mode writes: one JSONL file per process incarnation.

Each line is one event, written with a single os.write on an O_APPEND file (no buffer), so a
process that SIGKILLs itself loses nothing it logged before:
  {"t": time.time(), "replica": id, "event": "start"}               once, when the process starts
  {"t": time.time(), "replica": id, "event": "commit", "step": s}   after each committed optimizer step
  {"t": time.time(), "replica": id, "event": "failure", "kind": k, "at_s": a}   optional: just before
                                         the schedule's event (due at run start + a) fires here

`s` is the global step index: the number of steps committed before this one, so a step redone
after a restart (from a checkpoint, or healed to a peer's step) repeats its index. The files go
in a folder the driver names; benchmarks/ft/goodput_metrics.py reads them. The "failure" events
let it time a recovery from the moment the failure happened (the Injector fires at the first
mid-step poll after the event's time, up to a step later, and never in a process that started
after it) rather than from the schedule's time; `poll` logs them and polls the Injector.
"""
from __future__ import annotations

import json
import os
import time


class EventLog:
    """One process incarnation's event file; writes the "start" event on construction.

    Args:
        log_dir: the run's log folder (created if missing).
        replica: this process's replica id (its rank in the restart mode).

    Example:
        log = EventLog(log_dir, replica=0)   # {"event": "start"} is written here
        ...
        log.poll(injector)                   # mid-step: logs a due failure, then the Injector fires it
        log.commit(step)                     # after the optimizer step of global step `step`
    """

    def __init__(self, log_dir: str, replica: int):
        if not isinstance(replica, int) or replica < 0:
            raise ValueError(f"replica={replica!r} must be an int >= 0")
        os.makedirs(log_dir, exist_ok=True)
        self.replica = replica
        # pid and a nanosecond clock: a restarted replica never reuses an earlier incarnation's file
        self.path = os.path.join(log_dir, f"replica{replica}_pid{os.getpid()}_{time.time_ns()}.jsonl")
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write({"event": "start"})

    def commit(self, step: int) -> None:
        """Record that global step `step` (the count of steps committed before it) was committed."""
        self._write({"event": "commit", "step": int(step)})

    def failure(self, kind: str, at_s: float) -> None:
        """Record that the schedule's `kind` event due at run start + `at_s` fires now in this process."""
        self._write({"event": "failure", "kind": kind, "at_s": at_s})

    def poll(self, injector) -> None:
        """Log each of workload.Injector's due events as a "failure", then let the Injector fire them."""
        now = time.time() - injector.run_start
        for e in injector.events:
            if e["at_s"] <= now:
                self.failure(e["kind"], e["at_s"])
        injector.poll()

    def close(self) -> None:
        """Close the file (the events are on disk already)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, fields: dict) -> None:
        line = json.dumps({"t": time.time(), "replica": self.replica, **fields}) + "\n"
        os.write(self._fd, line.encode())


def add_run_arguments(p) -> None:
    """The arguments every mode's worker takes: where to log, the schedule, the run's window, the hang."""
    p.add_argument("--log-dir", required=True, help="the event logs' folder")
    p.add_argument("--schedule", required=True, help="the failure schedule's JSON file")
    p.add_argument("--run-start", type=float, required=True, help="the run's start, time.time() seconds")
    p.add_argument("--deadline", type=float, required=True, help="the run's end, time.time() seconds")
    p.add_argument("--hang-s", type=float, default=6.0, help="how long a hang sleeps (default 6)")

