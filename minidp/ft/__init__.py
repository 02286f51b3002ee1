"""Fault tolerance across replicas: a quorum each round, a commit vote, healing from a live peer.

    python -m minidp.run --ft --nproc-per-node 3 train.py     # a coordinator + 3 replicas; a dead
                                                            # replica is restarted alone and heals
Read in order: membership.py (who is in a round), coordinator.py (the one decider), replica.py (a
replica's side of a round), policies.py (what a round averages), transfer.py (healing over HTTP),
data.py (the samples of a round), replay.py (the reference a run is checked against).
"""
import importlib

_WHERE = {"SampleStream": "data", "AverageGradients": "policies", "DiLoCo": "policies",
          "ordered_mean": "policies", "Replica": "replica", "Round": "replica", "RunFinished": "replica"}
__all__ = sorted(_WHERE)


def __getattr__(name):
    """Import on first use: `python -m minidp.ft.coordinator` quiets torch's logging before torch loads."""
    if name not in _WHERE:
        raise AttributeError(f"module 'minidp.ft' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
