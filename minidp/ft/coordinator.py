"""The coordinator: holds the store the replicas meet in, forms each round's quorum, decides each commit.

    python -m minidp.ft.coordinator --port 29600 --min-replicas 2      # or: python -m minidp.run --ft

It does not train, so it survives the loss of any training process (torchft's lighthouse, without a
server binary: torch's TCPStore is the wire, this loop the only decider). One round at a time:
  1. quorum: it publishes the open round `r` and waits for the replicas to ask (`ask/r/<id>`): for
     every member of the last round that is alive, up to `join_timeout` after the first ask (a hung
     replica is left out then; a dead one as soon as its heartbeat stops). The replicas holding the
     newest state (the most committed steps) are the round's participants; the others are told to
     heal from them after the round (`quorum/r`).
  2. commit: each participant votes (`vote/r/<id>`) after its step; the round commits only if every
     participant voted yes. The first "no", a participant's death or `vote_timeout` after the first
     vote decides "no" at once (`decision/r`). One decider, so every replica reads the same answer.
Membership changes are printed, one line each, to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

# Each wait on the store that times out (every POLL_S while a round waits) would log a warning.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import torch.distributed as dist  # noqa: E402

from ..validate import check_int, check_number  # noqa: E402
from .membership import Liveness, decide_quorum

POLL_S = 0.05  # how long one blocking wait on the store lasts before the loop looks around


class Coordinator:
    """The decision loop over a TCPStore it hosts.

    Args:
        port: the TCP port of the store (0: a free one, see `.port`).
        min_replicas: a round needs at least this many replicas asking, >= 1. Default 1.
        max_replicas: how many replica ids exist (0 ... max_replicas - 1), or None: any. Default None.
        join_timeout: seconds a round waits for a member of the last round after the first ask. Default 5.
        heal_timeout: the same wait for a replica that was told to heal (it loads first). Default 60.
        vote_timeout: seconds after the first vote that the others must have voted by. Default 30.
        host: the address to listen on. Default "127.0.0.1".
    """

    def __init__(self, port: int = 0, min_replicas: int = 1, max_replicas: int | None = None,
                 join_timeout: float = 5.0, heal_timeout: float = 60.0, vote_timeout: float = 30.0,
                 host: str = "127.0.0.1"):
        self.min_replicas = check_int("min_replicas", min_replicas, low=1)
        if max_replicas is not None:
            check_int("max_replicas", max_replicas, low=1)
            if min_replicas > max_replicas:
                raise ValueError(f"min_replicas={min_replicas} is larger than the {max_replicas} replicas "
                                 "there are: no round could ever form")
        self.max_replicas = max_replicas
        self.join_timeout = check_number("join_timeout", join_timeout, positive=True)
        self.heal_timeout = check_number("heal_timeout", heal_timeout, positive=True)
        self.vote_timeout = check_number("vote_timeout", vote_timeout, positive=True)
        self.store = dist.TCPStore(host, check_int("port", port, low=0), is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=30))
        self.port = self.store.port
        self.liveness = Liveness(self.store)
        self.round = 0
        self.last = None  # the last published quorum (a dict), or None before the first
        self.newest, self.holders = 0, set()  # the run's committed steps, and who committed the last

    # ----------------------------------------------------------------------------------- the loop
    def serve(self, stop_after_s: float | None = None) -> int:
        """Run rounds until every replica has left (`left/<id>` for all: 0), the run's newest state is
        lost with the replicas that held it (1), or `stop_after_s` passes (0)."""
        deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
        while deadline is None or time.monotonic() < deadline:
            self.round += 1
            quorum = self._form_quorum(deadline)
            if quorum is None:
                return 0
            self._announce(quorum)
            self.store.set(f"quorum/{self.round}", json.dumps(quorum))
            if quorum.get("end", "").startswith("lost"):
                time.sleep(1.0)  # the replicas waiting on this round read it before the store goes
                return 1
            committed = self._decide(quorum) if quorum["participants"] and quorum["train"] else True
            if committed and quorum["train"]:
                self.newest, self.holders = quorum["step"] + 1, set(quorum["participants"])
            self.last = {**quorum, "committed": committed}

    def _form_quorum(self, deadline):
        """Wait for the asks of round `self.round`; the quorum (a dict), or None when all have left."""
        r = self.round
        self.store.set("round", str(r))
        first_ask, asks = None, {}
        while True:
            ids = self.liveness.known_ids()
            left = {i for i in ids if self.store.check([f"left/{i}"])}
            if ids and left == set(ids) and not asks:
                return None
            for i in ids:
                if i not in asks and self.store.check([f"ask/{r}/{i}"]):
                    asks[i] = json.loads(self.store.get(f"ask/{r}/{i}"))
                    first_ask = first_ask or time.monotonic()
            waiting = self._still_expected(asks, left)
            late = first_ask is not None and time.monotonic() - first_ask > self._patience(waiting)
            if len(asks) >= self.min_replicas and (not waiting or late):
                behind = self._behind(asks, left)
                if behind is None:
                    return decide_quorum(r, asks, self.last)
                if behind:  # "" : a holder of the newest state is alive: wait for it
                    return {**decide_quorum(r, asks, None), "participants": [], "heal": {},
                            "train": False, "seed_source": None, "end": behind}
            if deadline is not None and time.monotonic() > deadline:
                return None
            self._wait_any([f"ask/{r}/{i}" for i in (waiting or ids) if i not in asks])

    def _behind(self, asks, left):
        """None when some asker holds the run's newest state; else why the run ends ("" to wait).

        A round never trains an older state than the run's newest: if only stale replicas ask,
        they wait for a holder of the newest to come back; when all holders have left (the run
        finished) or died (its newest state is lost), the stale replicas are told so.
        """
        if not self.newest or any(a["has_state"] and a["step"] >= self.newest for a in asks.values()):
            return None
        holders = self.holders - set(asks)
        if holders and holders <= left:
            return "finished"
        if not any(self.liveness.alive(i) for i in holders - left):
            return (f"lost: the run's newest state (step {self.newest}) died with replicas "
                    f"{sorted(holders - left)}")
        return ""

    def _still_expected(self, asks, left) -> set:
        """Members of the last round (participants and healers) not yet asking, alive and not gone.

        Before the first round: every replica id there is (max_replicas), so the run starts together.
        """
        if self.last is None:
            return set(range(self.max_replicas or 0)) - set(asks)
        members = set(self.last["participants"]) | {int(i) for i in self.last["heal"]}
        return {i for i in members - set(asks) - left if self.liveness.alive(i)}

    def _patience(self, waiting: set) -> float:
        healing = self.last is not None and any(str(i) in self.last["heal"] for i in waiting)
        return self.heal_timeout if healing else self.join_timeout

    def _decide(self, quorum) -> bool:
        """Collect the participants' votes; publish commit or not as soon as it is known; commit?"""
        r, voters = quorum["round"], quorum["participants"]
        first_vote, votes = None, {}
        while True:
            for i in voters:
                if i not in votes and self.store.check([f"vote/{r}/{i}"]):
                    votes[i] = json.loads(self.store.get(f"vote/{r}/{i}"))
                    first_vote = first_vote or time.monotonic()
            why = next((f"replica {i}: {v['why']}" for i, v in votes.items() if not v["ok"]), None)
            dead = [i for i in voters if i not in votes and not self.liveness.alive(i)]
            if why is None and dead:
                why = f"replica {dead[0]} died during the step"
            if why is None and first_vote and time.monotonic() - first_vote > self.vote_timeout:
                missing = [i for i in voters if i not in votes]
                why = f"replica {missing[0]} did not vote within vote_timeout={self.vote_timeout} s"
            if why is not None or len(votes) == len(voters):
                decision = {"commit": why is None, "why": why}
                self.store.set(f"decision/{r}", json.dumps(decision))
                if why is not None:
                    _say(f"round {r} (step {quorum['step']}): discarded: {why}")
                return why is None
            self._wait_any([f"vote/{r}/{i}" for i in voters if i not in votes])

    def _wait_any(self, keys) -> None:
        """Block until the first of `keys` exists, for at most POLL_S (then the loop looks around)."""
        try:
            self.store.wait(keys[:1] or ["never"], timedelta(seconds=POLL_S))
        except (RuntimeError, dist.DistStoreError):
            pass

    def _announce(self, quorum) -> None:
        if quorum.get("end"):
            _say(f"round {quorum['round']}: {quorum['end']}; stale replicas told so")
            return
        before = set() if self.last is None else set(self.last["participants"])
        now = set(quorum["participants"])
        heal = ", ".join(f"{i} from {src[0]}" for i, src in quorum["heal"].items())
        if now != before or heal:
            _say(f"round {quorum['round']} (step {quorum['step']}): participants {sorted(before)} -> "
                 f"{sorted(now)}" + (f"; healing {heal}" if heal else ""))


def _say(line: str) -> None:
    print(f"[minidp.ft] {line}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    """`python -m minidp.ft.coordinator`: host the store and decide rounds until every replica left."""
    p = argparse.ArgumentParser(prog="python -m minidp.ft.coordinator", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=None)
    p.add_argument("--join-timeout", type=float, default=5.0)
    p.add_argument("--heal-timeout", type=float, default=60.0)
    p.add_argument("--vote-timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    try:
        c = Coordinator(a.port, a.min_replicas, a.max_replicas, a.join_timeout, a.heal_timeout,
                        a.vote_timeout, a.host)
    except (ValueError, TypeError) as exc:
        print(f"minidp.ft.coordinator: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # the port is taken, or the address is not this machine's
        print(f"minidp.ft.coordinator: error: cannot listen on {a.host}:{a.port}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 2
    _say(f"coordinator listening on {a.host}:{c.port} (min_replicas={a.min_replicas})")
    return c.serve()


if __name__ == "__main__":
    sys.exit(main())
