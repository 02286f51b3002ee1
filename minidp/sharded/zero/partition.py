"""Which rank steps which parameter: torch ZeroRedundancyOptimizer's sorted-greedy partition.

Pure functions over lists of tensors (no process group), so every rank computes the same answer
from the same parameter groups without a collective, and tests check it without processes.

The rule, per parameter group in order: sort the group's parameters by number of elements, largest
first (a stable sort: equal sizes keep their order); give each to the rank with the fewest elements
so far, counting the groups before it too (the lowest rank on a tie). Largest-first keeps the shards
near-equal: the small parameters at the end fill the gaps the large ones left. A parameter is never
split across ranks, so one huge parameter makes an uneven shard. torch's rule is the same
(`_partition_parameters`), which is what lets a state dict move between the two.
"""
from __future__ import annotations

import copy
from typing import Any

import torch


def min_index(values: list[int]) -> int:
    """The index of the smallest value; the first such on a tie (`values.index(min(values))`)."""
    best = 0
    for i, value in enumerate(values):
        if value < values[best]:
            best = i
    return best


def assign_ranks(sizes: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """The rank of each of `sizes` (element counts, in sorting order), assigned greedily.

    Args:
        sizes: element counts, already sorted largest first.
        world_size: the number of ranks.
        loads: elements each rank holds already (the groups before this one); updated in place.
            Default None: every rank starts empty.
    """
    loads = [0] * world_size if loads is None else loads
    ranks = []
    for size in sizes:
        rank = min_index(loads)
        ranks.append(rank)
        loads[rank] += size
    return ranks


def partition_parameters(param_groups: list[dict[str, Any]], world_size: int) -> list[list[dict]]:
    """Each rank's parameter groups: partition[rank][g] is group g with only that rank's parameters.

    Every rank gets one group per input group, empty or not, so local group g always matches
    global group g (the state dict and the hyperparameter sync rely on that). A rank's parameters
    within a group are in sorting order (largest first), the order of its local optimizer's state.

    Args:
        param_groups: the optimizer's groups (dicts with "params" and hyperparameters); each output
            group is a shallow copy with its own "params" list.
        world_size: the number of ranks.
    """
    partition: list[list[dict]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for group in param_groups:
        params = sorted(group["params"], key=lambda t: t.numel(), reverse=True)
        ranks = assign_ranks([p.numel() for p in params], world_size, loads)
        for rank in range(world_size):
            shard = copy.copy(group)
            shard["params"] = [p for p, r in zip(params, ranks) if r == rank]
            partition[rank].append(shard)
    return partition


def owners(partition: list[list[dict]]) -> dict[torch.Tensor, int]:
    """Parameter -> the rank that steps it (tensors hash by identity)."""
    return {p: rank for rank, groups in enumerate(partition) for g in groups for p in g["params"]}


def shard_params(partition: list[list[dict]], rank: int) -> list[torch.Tensor]:
    """The parameters `rank` steps, group by group, in its local optimizer's order."""
    return [p for group in partition[rank] for p in group["params"]]
