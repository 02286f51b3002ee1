"""A recorder of what happens inside one step: gradients ready, buckets launched and completed.

Off by default: the reducer checks `timeline is not None` and does nothing else.
Turn it on with `model.enable_timeline()`; each event is (kind, time_ns, fields).
"""
from __future__ import annotations

import threading
import time


class Timeline:
    """Thread-safe list of events; communication completions are recorded from comm threads."""

    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []
        self._lock = threading.Lock()

    def record(self, kind: str, **fields) -> None:
        stamp = time.perf_counter_ns()
        with self._lock:
            self.events.append((kind, stamp, fields))

    def watch(self, future, **fields) -> None:
        """Record a "done" event when `future` completes (called on the thread that completes it)."""
        future.add_done_callback(lambda _: self.record("done", **fields))

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.events]

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
