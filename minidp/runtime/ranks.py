"""Rank helpers from the mp.spawn workflow: print once, log with the rank, download once per node.

They read the rank from the default process group when there is one, else from torchrun's
variables, so they also work before init() and in a plain single-process run.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Optional

import torch.distributed as dist

from .watchdog import naming_laggards


def get_rank() -> int:
    """Global rank: the process group's when initialised, else RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def get_local_rank() -> int:
    """Rank within this node: LOCAL_RANK (set by torchrun, minidp.run, launch and init), else 0."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    """True on global rank 0 only."""
    return get_rank() == 0


def print0(*args, **kwargs) -> None:
    """print() on global rank 0; nothing elsewhere. Flushes, so lines are not lost on a crash."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = get_rank()  # looked up per record: the logger may be made before init()
        return True


def get_logger(name: str = "minidp", level: int = logging.INFO) -> logging.Logger:
    """A logger whose lines start with `[rank N]`.

    Example:
        log = minidp.get_logger(); log.info("epoch %d", epoch)   # [rank 1] epoch 3
    """
    if not isinstance(name, str):
        raise TypeError(f"name={name!r} must be a str")
    logger = logging.getLogger(name)
    if not any(getattr(h, "_minidp", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._minidp = True
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger


def _check_group(group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed.ProcessGroup or None (the world)")


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    """Wait until every rank of `group` (default: the world) gets here; a no-op without a group."""
    _check_group(group)
    if dist.is_available() and dist.is_initialized():
        with naming_laggards("minidp.barrier()"):  # a failure names the ranks that did not arrive
            dist.barrier(group=group)  # ranks meet here


@contextlib.contextmanager
def local_rank_zero_first(group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """Run the block on local rank 0 of every node first, then on the other ranks.

    For work done once per node, such as downloading or generating a data set: the block on the
    other ranks finds the files already there. Every rank must enter it (it holds barriers).

    Example:
        with minidp.local_rank_zero_first():
            train_set = torchvision.datasets.CIFAR10(root, download=True)
    """
    _check_group(group)
    first = get_local_rank() == 0
    if not first:
        barrier(group)  # ranks meet here: wait for local rank 0 of every node to finish the block
    yield
    if first:
        barrier(group)  # ranks meet here: release the waiting ranks
