"""The samples of a round, cut over its participants: nothing skipped, nothing repeated.

The run reads one endless stream of samples: epoch e is a permutation of the dataset drawn from
seed + e (as DistributedSampler shuffles). A round takes the next `inner_steps x participants x
batch_size` samples of the stream; participant i of inner step j reads its `batch_size` of them at
`(j x participants + i) x batch_size`. The stream moves on only when the round commits: a discarded
round is trained again on the same samples, cut over whoever takes part then. So a lost replica's
share of a step is trained by the replicas present at the retry, and every committed sample of the
stream is trained exactly once.
"""
from __future__ import annotations

import torch

from ..validate import check_bool, check_int


class SampleStream:
    """The run's position in its stream of samples; part of the state a joiner heals from.

    Args:
        dataset_size: samples in the dataset, >= 1.
        batch_size: samples a participant reads per inner step, >= 1.
        seed: the permutations' seed (epoch e uses seed + e). Default 0.
        shuffle: permute each epoch; False reads 0, 1, 2, ... Default True.
    """

    def __init__(self, dataset_size: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.dataset_size = check_int("dataset_size", dataset_size, low=1)
        self.batch_size = check_int("batch_size", batch_size, low=1)
        self.seed = check_int("seed", seed)
        self.shuffle = check_bool("shuffle", shuffle)
        self.consumed = 0  # samples of the stream trained by committed rounds
        self._perms: dict[int, torch.Tensor] = {}

    def indices(self, rank: int, participants: int, inner_step: int = 0) -> list[int]:
        """Dataset indices participant `rank` of `participants` reads at `inner_step` of this round."""
        start = self.consumed + (inner_step * participants + rank) * self.batch_size
        return [self._index(p) for p in range(start, start + self.batch_size)]

    def advance(self, participants: int, inner_steps: int) -> None:
        """Move past a committed round's samples."""
        self.consumed += inner_steps * participants * self.batch_size

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_size)
        if not self.shuffle:
            return offset
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perms = {epoch: torch.randperm(self.dataset_size, generator=g)}  # keep one epoch
        return int(self._perms[epoch][offset])

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "dataset_size": self.dataset_size,
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("dataset_size", "batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(f"the peer's sample stream has {key}={state[key]!r}, this replica's "
                                 f"{getattr(self, key)!r}: every replica must read the same stream")
        self.consumed = state["consumed"]
