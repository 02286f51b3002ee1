"""One replica of a fault-tolerant run: asks each round's quorum, trains, votes, heals when behind.

    replica = ft.Replica(model, ft.AverageGradients(optimizer), ft.SampleStream(len(data), 32))
    while replica.committed < steps:
        with replica.step() as r:                      # ranks meet: the round's quorum (heals first if behind)
            x, y = data[r.indices()]
            loss_fn(model(x), y).backward()
        # leaving the block: the mean over the participants, the vote, then the optimizer's step
        # on every participant, or on none (an exception in the block is a "no" vote, not a crash)
    replica.close()

The coordinator's address and this replica's id come from the arguments or from
MINIDP_FT_COORDINATOR ("host:port") and MINIDP_FT_REPLICA_ID, which `python -m minidp.run --ft` sets.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..validate import check_int, check_number
from .membership import HEARTBEAT_S, LEASE_S
from .policies import ordered_mean
from .transfer import StateServer, fetch_state, first_mismatch, signature

GRAVEYARD = 8  # failed collectives whose groups and buffers are kept alive


class Replica:
    """This process's membership in a fault-tolerant run.

    Args:
        model: the module trained (a plain module, or minidp.DDP over this replica's own ranks).
        policy: ft.AverageGradients(optimizer) or ft.DiLoCo(inner, outer, period).
        stream: ft.SampleStream, the run's position in its data (healed with the rest), or None.
        replica_id: this replica's id, >= 0. Default None: MINIDP_FT_REPLICA_ID.
        coordinator: "host:port" of the coordinator's store. Default None: MINIDP_FT_COORDINATOR.
        timeout: seconds a collective between replicas, or a state transfer, may take. Default 10.
        quorum_timeout: seconds to wait for a round to form before giving up. Default 300.
        max_consecutive_failures: this replica's own exceptions in a row before it re-raises. Default 3.
        record: a folder to record this replica's rounds and heals in (`replica<id>.jsonl`, a
            state digest after each commit), for `minidp.ft.replay.check_run`. Default None.
    """

    def __init__(self, model, policy, stream=None, replica_id=None, coordinator=None, timeout=10.0,
                 quorum_timeout=300.0, max_consecutive_failures=3, record=None):
        missing = [m for m in ("attach", "begin", "contribution", "commit", "discard", "state_dict")
                   if not hasattr(policy, m)]
        if missing:
            raise TypeError(f"policy={type(policy).__name__} is not a round policy (no {missing[0]}()): pass "
                            "ft.AverageGradients(optimizer) or ft.DiLoCo(inner, outer, period)")
        if stream is not None and not hasattr(stream, "indices"):
            raise TypeError(f"stream={type(stream).__name__} must be an ft.SampleStream or None")
        self.model, self.policy, self.stream = model, policy, stream
        self.id = check_int("replica_id", _from_env(replica_id, "MINIDP_FT_REPLICA_ID"), low=0)
        self.timeout = check_number("timeout", timeout, positive=True)
        self.quorum_timeout = check_number("quorum_timeout", quorum_timeout, positive=True)
        self.max_consecutive_failures = check_int("max_consecutive_failures", max_consecutive_failures, low=1)
        self.coordinator = str(_from_env(coordinator, "MINIDP_FT_COORDINATOR"))
        self.store = _connect(self.coordinator, self.timeout)
        self.record = record
        policy.attach(model)
        self.committed, self.has_state, self.failures_in_a_row = 0, False, 0
        self.last_round = 0  # the newest round this replica asked in
        self.groups: dict = {}  # epoch -> process group between that epoch's participants
        self.graveyard: list = []  # (group, buffers) of the last failed collectives, kept alive
        self._claim_id()
        self.server = StateServer(_reachable_host(self.coordinator))

    # --------------------------------------------------------------------------- joining the run
    def _claim_id(self) -> None:
        """Own this id (refused while a live process holds it), check the model, start beating."""
        token = f"pid {os.getpid()} on {socket.gethostname()} at {time.time():.3f}"
        holder = self.store.compare_set(f"owner/{self.id}", "", token).decode()
        if holder != token:
            beat = int(self.store.add(f"alive/{self.id}", 0))
            time.sleep(LEASE_S)
            if int(self.store.add(f"alive/{self.id}", 0)) != beat or \
                    self.store.compare_set(f"owner/{self.id}", holder, token).decode() != token:
                raise RuntimeError(f"replica_id={self.id} is held by a live process ({holder}): two replicas "
                                   "cannot share an id; give each its own MINIDP_FT_REPLICA_ID")
        self.incarnation = token  # this process, as against an earlier one with the same id
        mine = json.dumps(signature(self.model.state_dict()))
        run = self.store.compare_set("signature", "", mine).decode()
        if run != mine:
            raise ValueError(f"replica {self.id} refused: its model does not match the run's: "
                             f"{first_mismatch(json.loads(mine), json.loads(run))}")
        self.store.append("ids", f"{self.id},")
        beat_store = _connect(self.coordinator, self.timeout)  # its own connection: one per thread
        self._beating = threading.Event()
        threading.Thread(target=self._beat, args=(beat_store,), daemon=True, name="minidp-ft-beat").start()

    def _beat(self, store) -> None:
        while not self._beating.is_set():
            try:
                store.add(f"alive/{self.id}", 1)
            except Exception:  # the coordinator is gone: the main thread's next call says so
                return
            self._beating.wait(HEARTBEAT_S)

    # ------------------------------------------------------------------------------ one round
    def step(self) -> "Round":
        """The next round, as a context manager: enter forms the quorum, exit votes and commits."""
        return Round(self)

    def quorum(self) -> dict:
        """Ask the open round's quorum until this replica trains in one, healing when told to."""
        while True:
            asked = time.monotonic()
            q = self._ask()
            q["waited_s"] = round(time.monotonic() - asked, 4)  # for the record: what a round waited for
            if q.get("end"):
                self.close()  # the coordinator stops waiting for this replica
            if q.get("end") == "finished":
                raise RunFinished(f"replica {self.id}: the run finished at step {self.committed} without it "
                                  "(every replica holding the newest state has left)")
            if q.get("end"):
                raise RuntimeError(f"replica {self.id}: {q['end']}; nothing left to heal from")
            if q["train"] and self.id in q["participants"]:
                if not self.has_state or q["step"] != self.committed:  # the protocol's invariant, checked
                    held = "no state" if not self.has_state else f"step {self.committed}"
                    raise RuntimeError(f"replica {self.id}: round {q['round']} trains step {q['step']} but this "
                                       f"replica holds {held}")
                return q
            if str(self.id) in q["heal"]:
                self._heal(q)
            elif q["seed_source"] == self.id:  # the run's start: this replica's weights are the seed
                self.has_state = True
                self.server.publish(q["round"], self._state(q["round"]))
                self.store.set(f"serve/{q['round']}/{self.id}", self.server.address)

    def _ask(self) -> dict:
        """Ask in the open round (the next one, if that closed without us); its quorum naming us."""
        deadline = time.monotonic() + self.quorum_timeout
        # Never a round already taken part in: the coordinator may not have opened the next one yet
        # (asking ahead is fine: it reads the asks of a round when it opens it).
        round_id = max(int(self._wait_get("round", deadline)), self.last_round + 1)
        while True:
            ask = {"step": self.committed, "has_state": self.has_state, "incarnation": self.incarnation}
            self.store.set(f"ask/{round_id}/{self.id}", json.dumps(ask))
            q = json.loads(self._wait_get(f"quorum/{round_id}", deadline))
            self.last_round = round_id
            if q.get("end"):
                return q
            named = self.id in q["participants"] or str(self.id) in q["heal"] or q["seed_source"] == self.id
            if named and q["incarnations"].get(str(self.id)) == self.incarnation:
                return q
            if named:  # formed from the ask of this id's previous process, which died after asking
                self._stand_in_for_predecessor(q)
            round_id += 1  # asked after that round closed: ask in the next one

    def _stand_in_for_predecessor(self, q: dict) -> None:
        """Say at once that this id's role in round q is void: its peers need not time out on it.

        A participant's "no" vote discards the round before its peers start their collective (they
        check the decision first); a source's `gone` key sends its joiners to their next source.
        """
        r, why = q["round"], (f"replica {self.id} restarted after its previous process asked in round "
                              f"{q['round']}: that process's place in the round is void")
        if self.id in q["participants"]:
            self.store.set(f"vote/{r}/{self.id}", json.dumps({"ok": False, "why": why}))
        self.store.set(f"gone/{r}/{self.id}", why)

    def _heal(self, q: dict) -> None:
        """Load the state the sources hold after round q from the first that delivers it."""
        r, started, failed = q["round"], time.monotonic(), []
        for source in q["heal"][str(self.id)]:
            try:
                address = self._wait_served(r, source).decode()
                state = fetch_state(address, r, self.timeout)
            except Exception as exc:  # the source died before or during the transfer: the next one
                failed.append(f"replica {source}: {type(exc).__name__}: {exc}")
                continue
            self._load(state, source)
            self.last_heal = {"round": r, "source": source, "committed": self.committed,
                              "seconds": time.monotonic() - started, "failed": failed}
            self._record({"heal": True, **self.last_heal})
            return

    def _wait_served(self, round_id: int, source: int) -> bytes:
        """The source's address once it serves round_id's state (it trains the round first)."""
        key, deadline = f"serve/{round_id}/{source}", time.monotonic() + self.quorum_timeout
        beat, moved = None, time.monotonic()
        while True:
            if self.store.check([key]):
                return self.store.get(key)
            if self.store.check([f"gone/{round_id}/{source}"]):  # restarted: the new process has no state
                raise RuntimeError(self.store.get(f"gone/{round_id}/{source}").decode())
            time.sleep(0.05)
            now_beat = int(self.store.add(f"alive/{source}", 0))
            if now_beat != beat:
                beat, moved = now_beat, time.monotonic()
            elif time.monotonic() - moved > LEASE_S:
                raise RuntimeError(f"replica {source} died before serving its state")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {source} did not serve its state within "
                                   f"quorum_timeout={self.quorum_timeout} s")

    def _state(self, round_id: int) -> dict:
        return {"round": round_id, "committed": self.committed, "model": self.model.state_dict(),
                "policy": self.policy.state_dict(), "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "stream": None if self.stream is None else self.stream.state_dict()}

    def _load(self, state: dict, source: int) -> None:
        wrong = first_mismatch(signature(self.model.state_dict()), signature(state["model"]))
        if wrong:
            raise ValueError(f"replica {self.id} refused replica {source}'s state: {wrong}")
        self.model.load_state_dict(state["model"])
        self.policy.load_state_dict(state["policy"])
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        self.committed, self.has_state = state["committed"], True

    # ------------------------------------------------------------------------- the round's end
    def finish(self, q: dict, error: BaseException | None) -> bool:
        """Average, vote, and commit or discard round q; True if it committed."""
        self.last_quorum = q
        rank, count = q["participants"].index(self.id), len(q["participants"])
        why = None if error is None else f"{type(error).__name__}: {error}"
        try:
            # Ranks meet: a failed participant still sends (zeros), so its peers never wait on it.
            means = self._mean(q, self.policy.contribution(failed=error is not None), rank, count)
        except Exception as exc:  # a peer died or hung: this round cannot commit
            means, why = None, why or f"collective failed: {_first_sentence(exc)}"
        self.store.set(f"vote/{q['round']}/{self.id}", json.dumps({"ok": why is None, "why": why}))
        decision = json.loads(self._wait_get(f"decision/{q['round']}", time.monotonic() + self.quorum_timeout))
        if decision["commit"] and means is None:  # cannot happen: a failed collective votes "no"
            raise RuntimeError(f"replica {self.id}: round {q['round']} committed without this replica's mean")
        if decision["commit"]:
            self.policy.commit(means)
            self.committed += 1
            if self.stream is not None:
                self.stream.advance(count, self.policy.inner_steps)
        else:
            self.policy.discard()
            self.groups.pop(q["epoch"], None)  # a collective may have broken it
        entry = {"round": q["round"], "step": q["step"], "participants": q["participants"],
                 "committed": decision["commit"], "why": decision["why"], "waited_s": q["waited_s"]}
        if self.record is not None:
            from .replay import state_hash
            self._record({**entry, "hash": state_hash(self.model, self.policy)} if entry["committed"] else entry)
        if q["heal"]:  # joiners read the state after this round from its participants
            self.server.publish(q["round"], self._state(q["round"]))
            self.store.set(f"serve/{q['round']}/{self.id}", self.server.address)
        return decision["commit"]

    def _mean(self, q, contribution, rank, count):
        if count == 1:
            return contribution
        if self.store.check([f"decision/{q['round']}"]):  # decided without us: send nothing late
            raise RuntimeError(f"round {q['round']} was decided before this replica reached its collective")
        group = self.groups.get(q["epoch"])
        if group is None:
            self.groups = {}  # the old epochs' groups are done with
            store = dist.PrefixStore(f"pg/{q['epoch']}", self.store)
            group = dist.ProcessGroupGloo(store, rank, count, timedelta(seconds=self.timeout))
            self.groups[q["epoch"]] = group
        buffers: list = []
        try:
            return ordered_mean(contribution, group, rank, count, buffers)
        except Exception:
            # A timed-out receive may still be filled when the late peer sends: abort the group, and
            # keep it and its buffers alive (the last few failures' only) so that no other tensor
            # ever takes their memory while a write can still land there.
            try:
                group.abort()
            except Exception:
                pass
            self.graveyard = (self.graveyard + [(group, buffers)])[-GRAVEYARD:]
            raise

    # ---------------------------------------------------------------------------------- helpers
    def _wait_get(self, key: str, deadline: float) -> bytes:
        """The value of `key` once the coordinator (or a peer) sets it; a clear error at `deadline`."""
        while True:
            try:
                # One long wait (a wait that times out logs a warning in torch's C++ store client).
                self.store.wait([key], timedelta(seconds=max(0.05, deadline - time.monotonic())))
                return self.store.get(key)
            except (RuntimeError, dist.DistStoreError) as exc:
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise RuntimeError(f"replica {self.id}: the coordinator at {self.coordinator} is gone "
                                       f"({exc})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {self.id}: no answer for {key!r} from the coordinator at "
                                       f"{self.coordinator} in time (quorum_timeout={self.quorum_timeout} s; "
                                       "too few replicas for min_replicas?)") from None

    def _record(self, entry: dict) -> None:
        if self.record is not None:
            with open(os.path.join(self.record, f"replica{self.id}.jsonl"), "a") as f:
                f.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        """Leave the run: the coordinator stops waiting for this replica."""
        if self._beating.is_set():
            return
        self._beating.set()
        self.store.set(f"left/{self.id}", "1")
        self.server.close()


class RunFinished(SystemExit):
    """The run ended without this replica: raised by `step()`, it exits the process with status 0."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message
        print(f"[minidp.ft] {message}", file=sys.stderr, flush=True)


class Round:
    """One round as a context manager; inside, `indices()`, `rank`, `participants`, `step`."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.committed = None

    def __enter__(self) -> "Round":
        self.q = self.replica.quorum()
        self.participants, self.step = self.q["participants"], self.q["step"]
        self.rank = self.participants.index(self.replica.id)
        self.replica.policy.begin()
        return self

    def indices(self, inner_step: int = 0) -> list[int]:
        """This participant's sample indices for `inner_step` of the round (the stream's cut)."""
        return self.replica.stream.indices(self.rank, len(self.participants), inner_step)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not a failed step
        replica = self.replica
        self.committed = replica.finish(self.q, exc)
        replica.failures_in_a_row = replica.failures_in_a_row + 1 if exc is not None else 0
        return replica.failures_in_a_row < replica.max_consecutive_failures  # else re-raise


def _first_sentence(exc: BaseException) -> str:
    """gloo's error without its source path and its advice: "Connection closed by peer [...]:port"."""
    text = str(exc).split("] ", 1)[-1] if str(exc).startswith("[") else str(exc)
    return f"{type(exc).__name__}: {text.split('. ', 1)[0]}"


def _from_env(value, var: str):
    if value is not None:
        return value
    if var not in os.environ:
        raise ValueError(f"{var} is not set and no argument gives it: run under python -m minidp.run --ft, "
                         "or pass replica_id= and coordinator=")
    return int(os.environ[var]) if var.endswith("_ID") else os.environ[var]


def _connect(address: str, timeout: float):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator={address!r} must be 'host:port'")
    try:
        return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as exc:
        raise RuntimeError(f"no coordinator at {address} ({type(exc).__name__}): start one with "
                           "python -m minidp.ft.coordinator, or run under python -m minidp.run --ft") from None


def _reachable_host(coordinator: str) -> str:
    """The address of this machine that the coordinator's host can reach (loopback for loopback)."""
    host = coordinator.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]
