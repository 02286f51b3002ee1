"""DistributedSampler: torch's index math, written out, plus resumable state and an exact mode.

For the same arguments and epoch it yields exactly the indices torch.utils.data.DistributedSampler
yields, so minidp and torch DDP runs see the same data. Each epoch, every rank draws the same
permutation (seeded with seed + epoch, so ranks need not talk), pads it by repeating indices from its
start (or trims it with drop_last) to a multiple of num_replicas, and takes every num_replicas-th
index starting at its rank.

Beyond torch's:
  * state_dict()/load_state_dict() resume mid-epoch: the restored sampler yields exactly the indices
    of that epoch not yet consumed;
  * pad=False, the exact mode for evaluation: no index is repeated, ranks may get one index fewer;
  * epoch_mode="auto" advances the epoch on every new pass, and epoch_mode="strict" raises on a
    second pass of the same epoch: a forgotten set_epoch() cannot go unnoticed.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sized

import torch
from torch.utils.data import Sampler

from ..runtime.ranks import get_rank, get_world_size
from ..validate import check_bool, check_choice, check_int

EPOCH_MODES = ("manual", "auto", "strict")
_FINGERPRINT = ("dataset_len", "num_replicas", "shuffle", "drop_last", "pad", "seed")


class DistributedSampler(Sampler[int]):
    """Rank-aware sampler: torch's indices for the same arguments, plus resume and an exact mode.

    Args:
        dataset: anything with len(); only its length is used.
        num_replicas: number of ranks sharing the data. Default: the default process group's world
            size when initialised, else WORLD_SIZE from the environment, else 1.
        rank: this process's rank in [0, num_replicas). Default: the process group's rank, else
            RANK, else 0.
        shuffle: draw a new permutation every epoch (seeded with seed + epoch). Default True.
        seed: base seed; must be the same on every rank. Default 0.
        drop_last: trim the tail so every rank gets len(dataset) // num_replicas indices instead of
            padding up to ceil(len(dataset) / num_replicas). Default False.
        pad: keyword only. False selects the exact mode for evaluation: no padding, every index
            appears on exactly one rank, and ranks may get one index fewer than others (so never
            use it where every rank must run the same number of steps, as in DDP training).
            Default True (torch's behaviour). pad=False with drop_last=True is refused.
        epoch_mode: keyword only. How a pass that follows a pass of the same epoch is treated
            (a pass begins each time iter(sampler) is called, i.e. once per `for batch in loader`):
            "manual" (default): like torch, the same order again until set_epoch() is called;
            "auto": the epoch advances by one on every pass after the first (set_epoch() still
            jumps to an epoch);
            "strict": a second pass of the same epoch raises RuntimeError, so a forgotten
            set_epoch() fails on the spot instead of silently repeating the order.

    Example:
        sampler = minidp.DistributedSampler(train_set, seed=42)
        loader = DataLoader(train_set, batch_size=64, sampler=sampler)
        for epoch in range(start_epoch, epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                ...
                ckpt["sampler"] = sampler.state_dict(consumed=(step + 1) * 64)
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        pad: bool = True,
        epoch_mode: str = "manual",
    ) -> None:
        super().__init__()
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"dataset of type {type(dataset).__name__} has no len(); the sampler needs one")
        num_replicas = check_int("num_replicas", get_world_size() if num_replicas is None else num_replicas, 1)
        rank = check_int("rank", get_rank() if rank is None else rank)
        seed = check_int("seed", seed)
        shuffle, drop_last = check_bool("shuffle", shuffle), check_bool("drop_last", drop_last)
        pad, epoch_mode = check_bool("pad", pad), check_choice("epoch_mode", epoch_mode, EPOCH_MODES)
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        n = len(dataset)
        if drop_last and n == 0:
            raise ValueError(f"drop_last=True with an empty data set (len(dataset)={n}): nothing to sample")
        if drop_last and not pad:
            raise ValueError("drop_last=True drops samples, pad=False (exact mode) keeps each exactly once: pick one")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.pad, self.epoch_mode, self.epoch = pad, epoch_mode, 0
        self._len = n
        if not self.pad:
            self.num_samples = len(range(rank, n, num_replicas))
            self.total_size = n
        else:
            # torch: drop_last rounds down to a multiple of num_replicas, padding rounds up.
            self.num_samples = n // num_replicas if drop_last else -(-n // num_replicas)
            self.total_size = self.num_samples * num_replicas
        self._consumed = 0  # indices of this epoch handed out (or set by the caller)
        self._start = 0  # where the next pass starts: > 0 only after load_state_dict()
        self._fresh = True  # no pass has begun since construction, set_epoch() or load_state_dict()
        self._pass = 0  # id of the newest pass; only it may update _consumed

    def __len__(self) -> int:
        """Indices this rank gets per epoch (a resumed pass yields fewer: see `consumed`)."""
        return self.num_samples

    def indices(self, epoch: Optional[int] = None) -> List[int]:
        """This rank's indices for `epoch` (default: the current one), in order; changes no state."""
        epoch = self.epoch if epoch is None else check_int("epoch", epoch)
        n = self._len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)  # same permutation on every rank, without a collective
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        if self.pad and not self.drop_last:
            # torch repeats indices from the start, cycling when padding exceeds len(dataset).
            order += [order[i % n] for i in range(self.total_size - n)]
        return order[self.rank:self.total_size:self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self._len:
            raise RuntimeError(f"len(dataset) changed from {self._len} to {len(self.dataset)}: "
                               "build a new sampler for the new data set")
        self._begin_pass()
        start, self._start = self._start, 0
        self._pass += 1
        self._consumed = start
        return self._walk(self.indices(), start, self._pass)

    def _begin_pass(self) -> None:
        if not self._fresh:
            if self.epoch_mode == "strict":
                raise RuntimeError(
                    f"a second pass over epoch {self.epoch} without set_epoch() (epoch_mode='strict'): "
                    "call sampler.set_epoch(epoch) before every epoch, or use epoch_mode='auto'")
            if self.epoch_mode == "auto":
                self.epoch += 1
        elif self.epoch_mode == "auto" and self.num_samples > 0 and self._start == self.num_samples:
            # Resumed from a state saved after the epoch's last index: go straight to the next one.
            self.epoch, self._start = self.epoch + 1, 0
        self._fresh = False

    def _walk(self, indices: List[int], start: int, pass_id: int) -> Iterator[int]:
        for i in range(start, len(indices)):
            if pass_id == self._pass:  # an older, abandoned pass must not move the count
                self._consumed = i + 1
            yield indices[i]

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` for the next pass (shuffle order = permutation seeded with seed + epoch).

        Calling it with the epoch just restored by load_state_dict() keeps the resume point, so the
        usual `for epoch in range(start, n): sampler.set_epoch(epoch)` loop needs no change.
        """
        epoch = check_int("epoch", epoch)
        if epoch != self.epoch:
            self._start = 0
        self.epoch, self._consumed, self._fresh = epoch, self._start, True

    @property
    def consumed(self) -> int:
        """Indices of the current epoch handed out so far by the sampler's iterator.

        A DataLoader reads ahead of training (prefetch, worker queues), so this count can be ahead
        of what was trained on. Assign to it, or pass state_dict(consumed=n), to record the exact
        number of this rank's samples trained on (e.g. steps_done * batch_size).
        """
        return self._consumed

    @consumed.setter
    def consumed(self, value: int) -> None:
        self._consumed = self._check_position(value, "consumed")

    def _check_position(self, value: Any, name: str) -> int:
        value = check_int(name, value)
        if not 0 <= value <= self.num_samples:
            raise ValueError(f"{name}={value} must be in [0, {self.num_samples}] (this rank's indices per epoch)")
        return value

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """What load_state_dict() needs to continue this epoch where it stopped.

        Args:
            consumed: number of this rank's indices of the current epoch already used. Default:
                `self.consumed`, the count handed out by the iterator.
        """
        position = self._consumed if consumed is None else self._check_position(consumed, "consumed")
        return {"epoch": self.epoch, "consumed": position, "rank": self.rank, **self._fingerprint()}

    def _fingerprint(self) -> Dict[str, Any]:
        return {"dataset_len": self._len, "num_replicas": self.num_replicas, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "pad": self.pad, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a state: the next pass yields the indices of state["epoch"] not yet consumed.

        The state may come from any rank (in the usual case rank 0 saves the checkpoint): with
        padding or drop_last every rank has the same count, and `consumed` counts this rank's
        indices. Raises ValueError when the state was saved with another data set size,
        num_replicas, shuffle, drop_last, pad or seed, since the order would then differ.
        """
        missing = [k for k in ("epoch", "consumed", *_FINGERPRINT) if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; it has {sorted(state)}")
        mine = self._fingerprint()
        diff = [f"{k}: saved {state[k]!r}, this sampler {mine[k]!r}" for k in _FINGERPRINT if state[k] != mine[k]]
        if diff:
            raise ValueError("sampler state was saved with other settings (" + "; ".join(diff) + "): "
                             "build the sampler with the saved settings to resume")
        self.epoch = check_int("epoch", state["epoch"])
        self._start = self._consumed = self._check_position(state["consumed"], "consumed")
        self._fresh = True
