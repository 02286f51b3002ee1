"""The reference a fault-tolerant run is checked against: its membership replayed, no failure machinery.

One process, no coordinator, no collectives, no timeouts: for every committed round, in order,
each participant's state (model and policy) trains the round's body on its cut of the samples;
their contributions are summed in rank order and divided by their count; every participant
commits the mean. A heal copies the source's state to the joiner after the same number of
committed rounds. A run whose replicas end bitwise equal to this lost nothing to its failures.
Replay with the replicas' torch.get_num_threads(): a matmul's sums depend on it.
"""
from __future__ import annotations

import copy
import glob
import json
import os

import torch


def replay(build, body, rounds: list, heals: list) -> tuple[dict, dict]:
    """Replay `rounds`: every replica's final state, and each commit's state_hash.

    Returns:
        (states, hashes): replica id -> {"model", "policy", "stream"} state dicts after the last
        round; (step, replica id) -> state_hash of that replica right after committing `step`.

    Args:
        build: () -> (model, policy, stream): a fresh replica as the run builds it (same seed).
        body: (model, policy, stream, rank, count) -> None: one round's training, as the run's.
        rounds: the committed rounds in order: {"step", "participants"} each.
        heals: {"replica", "source", "committed"}: who loaded whose state after how many commits, in
            the order they happened. The run's start is a heal from the seed replica at 0 commits.
    """
    model, policy, stream = build()
    policy.attach(model)
    states: dict[int, dict] = {}

    def snapshot():
        return copy.deepcopy({"model": model.state_dict(), "policy": policy.state_dict(),
                              "stream": stream.state_dict()})

    def load(state):
        model.load_state_dict(state["model"])
        policy.load_state_dict(state["policy"])
        stream.load_state_dict(state["stream"])
        for p in model.parameters():
            p.grad = None

    seed, hashes = snapshot(), {}
    for committed, r in enumerate(rounds + [None]):
        for h in heals:
            if h["committed"] == committed:
                states[h["replica"]] = copy.deepcopy(states.get(h["source"], seed))
        if r is None:
            break
        contributions = []
        for rank, p in enumerate(r["participants"]):
            load(states.setdefault(p, copy.deepcopy(seed)))
            policy.begin()
            body(model, policy, stream, rank, len(r["participants"]))
            contributions.append(policy.contribution())
            states[p] = snapshot()
        means = []
        for k in range(len(contributions[0])):
            total = contributions[0][k].clone()
            for c in contributions[1:]:
                total.add_(c[k])
            means.append(total.div_(len(contributions)))
        for p in r["participants"]:
            load(states[p])
            policy.commit([m.clone() for m in means])
            stream.advance(len(r["participants"]), policy.inner_steps)
            states[p] = snapshot()
            hashes[(r["step"], p)] = state_hash(model, policy)
    return states, hashes


def state_hash(model, policy) -> str:
    """A digest of a replica's model and policy state: equal digests, equal bits."""
    import hashlib
    h = hashlib.sha256()
    for part in (model.state_dict(), policy.state_dict()):
        for t in _tensors(part):
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def read_record(folder: str) -> tuple[list, list, dict]:
    """The committed rounds, the heals and every commit's digests from a run's `record=` folder.

    Returns:
        (rounds, heals, digests): rounds as replay() takes them (each step once; every replica that
        recorded a step must have recorded the same participants); heals; (step, replica) -> digest.
    """
    by_step, heals, digests = {}, [], {}
    for path in sorted(glob.glob(os.path.join(folder, "replica*.jsonl"))):
        replica = int(os.path.basename(path)[len("replica"):-len(".jsonl")])
        with open(path) as f:
            for entry in map(json.loads, f):
                if entry.get("heal"):
                    heals.append({"replica": replica, "source": entry["source"], "committed": entry["committed"],
                                  "round": entry["round"]})
                elif entry["committed"]:
                    parts = by_step.setdefault(entry["step"], tuple(entry["participants"]))
                    if parts != tuple(entry["participants"]):
                        raise AssertionError(f"step {entry['step']} committed by {list(parts)} and by "
                                             f"{entry['participants']}: the run forked")
                    digests[(entry["step"], replica)] = entry["hash"]
    steps = sorted(by_step)
    if steps != list(range(len(steps))):
        raise AssertionError(f"committed steps are not 0 ... n-1 without a gap: {steps}")
    heals.sort(key=lambda h: h["round"])  # in the order they happened: a source may have healed first
    return [{"step": s, "participants": list(by_step[s])} for s in steps], heals, digests


def check_run(folder: str, build, body) -> dict:
    """Replay a recorded run and compare every commit's digest; a summary (mismatches listed)."""
    rounds, heals, digests = read_record(folder)
    states, hashes = replay(build, body, rounds, heals)
    wrong = sorted(key for key, digest in digests.items() if hashes.get(key) != digest)
    return {"steps": len(rounds), "commits": len(digests), "heals": len(heals), "mismatches": wrong,
            "states": states}
