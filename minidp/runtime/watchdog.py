"""Name a stuck or lost rank: every rank's progress in the store, and a waited-for rank's stack on request.

Why: when a collective times out or breaks, the rank that raises knows only that it waited. gloo says
"Connection closed by peer" or "Timed out", NCCL's flight recorder names collectives, not Python
lines; nothing says which rank never arrived, nor where it is stuck.

How, off the hot path: each rank keeps its place in memory (`Progress`: iteration, phase, bucket;
written by the engine per step and per bucket, never per gradient: minidp/engine/progress.py). A
daemon thread (`Watchdog`, started by minidp.init) publishes it to the process group's store within
LOOK_S of a change (at least every INTERVAL_S), with the rank's host and pid, and answers stack
requests: it prints its main thread's Python stack and writes it to the store. A rank whose
collective fails calls `report()`: it reads every rank's progress, names the ranks behind it (or
whose process is gone), asks those still alive for their stacks (waiting at most STACK_WAIT_S),
prints all that and returns it for the error.
Nothing here touches a tensor: the numbers a step computes do not change.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

INTERVAL_S = 0.25  # how often a rank looks for stack requests, and publishes its progress at the latest
LOOK_S = 0.05  # how often it looks whether its progress changed (then it publishes at once)
STACK_WAIT_S = 3.0  # how long a failing rank waits for the stacks it asked for
PHASES = ("start", "forward", "backward", "finalize", "after backward")  # the order of a step
_SAYS = {"start": "before its first forward", "forward": "in the forward",
         "backward": "in the backward", "finalize": "at the end of the backward, waiting for its buckets",
         "after backward": "after its backward (optimizer step, data loading or other code of the script)"}


class Progress:
    """This rank's place in training, written by the main thread (a few fields, no lock needed)."""

    def __init__(self):
        self.iteration, self.phase, self.bucket = 0, "start", None
        self.meetings = 0  # collectives entered outside the engine (naming_laggards): orders ranks between steps

    def update(self, iteration: int, phase: str, bucket: int | None = None) -> None:
        """Record a new place. Args: iteration (1 for the first step), phase (one of PHASES), bucket or None."""
        self.iteration, self.phase, self.bucket = iteration, phase, bucket

    def as_dict(self) -> dict:
        return {"iteration": self.iteration, "phase": self.phase, "bucket": self.bucket, "meetings": self.meetings}


def describe(record: dict | None) -> str:
    """A progress record in words, e.g. "iteration 6, in the backward (bucket 0 launched)"."""
    if record is None:
        return "no progress published (it never finished minidp.init())"
    bucket = "" if record["bucket"] is None else f" (bucket {record['bucket']} launched)"
    return f"iteration {record['iteration']}, {_SAYS.get(record['phase'], record['phase'])}{bucket}"


def _order(record: dict) -> tuple:
    bucket = -1 if record["bucket"] is None else record["bucket"]
    return record["iteration"], PHASES.index(record["phase"]), bucket, record.get("meetings", 0)


def process_alive(record: dict, host: str) -> bool | None:
    """Whether the rank's process still runs: True, False (gone, or a zombie), None (on another host)."""
    if record.get("host") != host:
        return None
    try:
        with open(f"/proc/{record['pid']}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): ask the kernel
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        return True


def _launcher_frame(filename: str) -> bool:
    """Frames of the launchers (minidp.run, runpy, minidp.launch's multiprocessing) before the user's code."""
    ours = (os.path.join("minidp", "run.py"), os.path.join("minidp", "worker.py"))
    return (filename in ("<string>", "<frozen runpy>") or filename.endswith(ours)
            or f"{os.sep}multiprocessing{os.sep}" in filename)


class Watchdog:
    """Publish this rank's progress and answer stack requests from a daemon thread; report() on failure.

    Args:
        store: the process group's store (minidp.init's); the watchdog keeps to its own keys.
        rank, world_size: this rank and the number of ranks.
        interval: seconds between two publications. Default INTERVAL_S.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, interval: float = INTERVAL_S):
        self.store, self.rank, self.world_size = dist.PrefixStore("minidp_watchdog/", store), rank, world_size
        self.interval, self.progress = interval, Progress()
        self.host, self.pid, self._main = socket.gethostname(), os.getpid(), threading.main_thread().ident
        self._beat, self._answered, self._lock = 0, 0, threading.Lock()  # the lock: one store call at a time
        self._stop = threading.Event()
        self._publish()  # a first record before anyone can look for it
        self._thread = threading.Thread(target=self._run, name="minidp-watchdog", daemon=True)
        self._thread.start()
        # Stopped before the interpreter finalizes: a thread inside a store call then could abort the exit.
        atexit.register(self.stop)

    def _run(self) -> None:
        # A change is published within LOOK_S (a rank that dies leaves its last place), a heartbeat and
        # a look for stack requests every `interval`: a few store calls a second, on this thread only.
        last, next_beat = None, 0.0
        while not self._stop.wait(min(LOOK_S, self.interval)):
            now, place = time.monotonic(), self.progress.as_dict()
            try:
                if place != last or now >= next_beat:
                    self._publish()
                    last = place
                if now >= next_beat:
                    self._answer()
                    next_beat = now + self.interval
            except Exception:  # the store is gone (its host died or ended): nothing left to tell
                return

    def _publish(self) -> None:
        self._beat += 1
        record = dict(self.progress.as_dict(), pid=self.pid, host=self.host, beat=self._beat, time=time.time())
        with self._lock:
            self.store.set(f"progress/{self.rank}", json.dumps(record))

    def _answer(self) -> None:
        """If a peer asked for this rank's stack since the last look: print it, and write it for every ask."""
        with self._lock:
            asked = self.store.add(f"ask/{self.rank}", 0)
        if asked <= self._answered:
            return
        text = self.stack()
        print(f"minidp: rank {self.rank} (pid {self.pid}) is a rank its peers wait for; it is "
              f"{describe(self.progress.as_dict())}; its main thread is here:\n{text}", file=sys.stderr, flush=True)
        with self._lock:
            for n in range(self._answered + 1, asked + 1):
                self.store.set(f"stack/{self.rank}/{n}", text)
        self._answered = asked

    def stack(self) -> str:
        """The main thread's Python stack, innermost call last, without the launcher's frames."""
        frame = sys._current_frames().get(self._main)
        if frame is None:
            return "(the main thread has ended)\n"
        frames = [f for f in traceback.extract_stack(frame) if not _launcher_frame(f.filename)]
        return "".join(traceback.format_list(frames))

    def stop(self) -> None:
        """Stop the thread (waits for its current store call, at most a few seconds). Safe to call twice."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        atexit.unregister(self.stop)

    def report(self, what: str) -> str:
        """Name the ranks this one waited for, with their progress and stacks; print and return the text.

        Args:
            what: what this rank waited in, e.g. "the all-reduce of bucket 0".
        """
        try:
            return self._report(what)
        except Exception as exc:  # the store itself is gone: say so rather than hide the first error
            text = (f"minidp: rank {self.rank} could not read its peers' progress ({type(exc).__name__}: {exc}); "
                    "the store is hosted by rank 0 (or torchrun's agent): it may have died")
            print(text, file=sys.stderr, flush=True)
            return text

    def _report(self, what: str) -> str:
        me = self.progress.as_dict()
        records = self._read_records()
        others = [r for r in range(self.world_size) if r != self.rank]
        alive = {r: process_alive(records[r], self.host) if records[r] else None for r in others}
        late = [r for r in others if records[r] is None or alive[r] is False or _order(records[r]) < _order(me)]
        # Nobody behind (e.g. a collective of the script's own): every peer's stack says more than none.
        stacks = self._ask_stacks([r for r in (late or others) if records[r] and alive[r] is not False])
        if any(alive[r] is None for r in late):  # on other hosts: alive if the thread still publishes
            later = self._read_records()
            for r in late:
                if alive[r] is None and records[r] and later[r]:
                    alive[r] = later[r]["beat"] > records[r]["beat"] or r in stacks
        head = (f"minidp: rank {self.rank} ({describe(me)}) waited in vain in {what}; ranks that did not arrive: "
                f"{late}" if late else f"minidp: rank {self.rank} ({describe(me)}) failed in {what}; no rank is "
                "behind it (a rank may have run other collectives)")
        lines = [head] + [self._line(r, records[r], alive[r], stacks.get(r)) for r in (late or others)]
        text = "\n".join(lines)
        print(text, file=sys.stderr, flush=True)
        return text

    def _line(self, rank: int, record, alive, stack) -> str:
        where = f"pid {record['pid']} on {record['host']}, last heard {time.time() - record['time']:.1f} s ago" \
            if record else "never seen"
        state = {False: "its process is gone (it died or was killed)", True: "alive",
                 None: "not answering (dead, or frozen in C code holding the GIL)"}[alive]
        text = f"  rank {rank} ({where}): {describe(record)}; {state}"
        if stack:
            text += "; its main thread:\n" + "".join(f"    {line}\n" for line in stack.rstrip().splitlines())
        elif record and alive is not False:
            text += f"; no stack within {STACK_WAIT_S:g} s (frozen in C code holding the GIL?)"
        return text.rstrip()

    def _read_records(self) -> dict:
        found = {}
        with self._lock:
            for r in range(self.world_size):
                key = f"progress/{r}"
                found[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return found

    def _ask_stacks(self, ranks: list) -> dict:
        """Ask `ranks` for their stacks; {rank: text} of those that answered within STACK_WAIT_S."""
        with self._lock:
            keys = {r: f"stack/{r}/{self.store.add(f'ask/{r}', 1)}" for r in ranks}
        stacks, deadline = {}, time.monotonic() + STACK_WAIT_S
        while len(stacks) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
            with self._lock:
                for r, key in keys.items():
                    if r not in stacks and self.store.check([key]):
                        stacks[r] = self.store.get(key).decode()
        return stacks


_current: Watchdog | None = None  # the default process group's, like torch's default group itself


def start(store: dist.Store, rank: int, world_size: int) -> Watchdog:
    """Start the default group's watchdog (minidp.init does); stops one left from an earlier init."""
    global _current
    stop()
    _current = Watchdog(store, rank, world_size)
    return _current


def current() -> Watchdog | None:
    """The default group's watchdog, or None (no minidp.init, or a world of one)."""
    return _current


@contextlib.contextmanager
def naming_laggards(what: str):
    """Around a collective outside the engine: a RuntimeError from it ends with the watchdog's report.

    Args:
        what: what the ranks meet in, e.g. "minidp.barrier()".
    """
    if _current is not None:
        _current.progress.meetings += 1
    try:
        yield
    except RuntimeError as exc:
        if _current is None:
            raise
        raise RuntimeError(f"{exc}\n{_current.report(what)}") from exc


def stop() -> None:
    """Stop the default group's watchdog, if any (minidp.shutdown does)."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None
