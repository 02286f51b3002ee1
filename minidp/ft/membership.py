"""Who is in a round: the quorum rule (pure, tested without processes) and liveness from heartbeats.

The rule, for the replicas that asked in time (each says how many steps it has committed, and
whether it holds a state at all: a fresh process does not):
  * participants: the replicas holding the newest state (the most committed steps). They train
    the round's step together, in id order (rank i = the i-th smallest id).
  * heal: every other replica that asked, each with its sources (the participants, rotated so that
    joiners spread over them); it loads the state the sources hold after the round and asks again.
  * when no one holds a state (the run's start), the smallest id is the source and no step is
    trained this round: every replica starts from its weights, as DDP broadcasts rank 0's.
  * incarnations: which process each asker's ask came from. A replica restarted after its ask
    was read would otherwise take its dead predecessor's place (and train a step from the seed
    weights): it acts on a quorum only if the quorum names its own incarnation.
  * epoch: the process group between participants is reused while the participants stay the same
    and every round commits; any change, or a discarded round (a collective may have broken it),
    starts a new one.
"""
from __future__ import annotations

import time

LEASE_S = 1.0  # a replica whose heartbeat counter has not moved for this long is dead
HEARTBEAT_S = 0.1  # how often a replica beats (replica.py)


def decide_quorum(round_id: int, asks: dict, last: dict | None) -> dict:
    """The quorum of one round from the asks received, and the last round's quorum (None at first).

    Args:
        round_id: the round being formed.
        asks: replica id -> {"step": committed steps, "has_state": bool, "incarnation": the asking
            process's token (optional)}.
        last: the previous round's quorum with its decision merged in ("committed"), or None.
    """
    incarnations = {str(i): a.get("incarnation") for i, a in asks.items()}
    holders = {i: a["step"] for i, a in asks.items() if a["has_state"]}
    if not holders:  # the run's start: the smallest id's weights are everyone's
        source = min(asks)
        return _quorum(round_id, 0, [], {i: [source] for i in asks if i != source}, last, train=False,
                       seed_source=source, incarnations=incarnations)
    newest = max(holders.values())
    participants = sorted(i for i, s in holders.items() if s == newest)
    joiners = sorted(i for i in asks if i not in participants)
    heal = {i: participants[k % len(participants):] + participants[:k % len(participants)]
            for k, i in enumerate(joiners)}
    return _quorum(round_id, newest, participants, heal, last, train=True, incarnations=incarnations)


def _quorum(round_id, step, participants, heal, last, train, seed_source=None, incarnations=None) -> dict:
    same = (last is not None and last["participants"] == participants and last.get("committed", False))
    epoch = last["epoch"] if same else (0 if last is None else last["epoch"]) + 1
    return {"round": round_id, "step": step, "participants": participants,
            "heal": {str(i): src for i, src in heal.items()}, "epoch": epoch, "train": train,
            "seed_source": seed_source, "incarnations": incarnations or {}}


class Liveness:
    """Which replicas are alive: each beats a counter in the store (`alive/<id>`), a dead one stops.

    A hung process still beats (its heartbeat thread runs): a hang is found by the round's timeouts,
    not here. Ids are those that registered (`ids`, an append-only list in the store).

    Args:
        store: the coordinator's store.
        lease_s: how long a counter may stand still before its replica counts as dead. Default LEASE_S.
    """

    def __init__(self, store, lease_s: float = LEASE_S):
        self.store, self.lease_s = store, lease_s
        self.seen: dict[int, tuple[int, float]] = {}  # id -> (counter, when it last moved)
        self.asked: dict[int, float] = {}  # id -> when the store was last asked

    def known_ids(self) -> list[int]:
        if not self.store.check(["ids"]):
            return []
        text = self.store.get("ids").decode()
        return sorted({int(i) for i in text.split(",") if i})

    def alive(self, replica: int) -> bool:
        now = time.monotonic()
        before = self.seen.get(replica)
        if before is not None and now - self.asked.get(replica, 0.0) < HEARTBEAT_S:
            return now - before[1] < self.lease_s  # asked the store a moment ago: no new beat to see
        self.asked[replica] = now
        key = f"alive/{replica}"
        if not self.store.check([key]):
            return False
        count = int(self.store.add(key, 0))
        if before is None or before[0] != count:
            self.seen[replica] = (count, now)
            return True
        return now - before[1] < self.lease_s
