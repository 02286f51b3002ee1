"""Bucket planning, checked against torch's own C++ assignment (used here only as the reference)."""
import random

import pytest
import torch
import torch.distributed as dist

from harness import sizes_and_keys
from minidp.engine.planning import MIB, UNBOUNDED, assign_buckets, bucket_limits, plan_initial, plan_rebuilt

DTYPES = [torch.float32, torch.float64, torch.float16]


def _random_tensors(rng, n):
    return [torch.empty(rng.choice([1, 7, 100, 5000, 70000, 300000]), dtype=rng.choice(DTYPES)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_initial_assignment_equals_torch(seed):
    rng = random.Random(seed)
    tensors = _random_tensors(rng, rng.randint(1, 30))
    limits = rng.choice([[UNBOUNDED], [MIB, 25 * MIB], [4096], [1000, 50000], [MIB]])
    expected, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    assert assign_buckets(*sizes_and_keys(tensors), limits) == expected


@pytest.mark.parametrize("seed", range(40))
def test_rebuilt_assignment_equals_torch(seed):
    rng = random.Random(1000 + seed)
    tensors = _random_tensors(rng, rng.randint(1, 30))
    tensors = [t.to(torch.float32) for t in tensors]  # one dtype: torch's leftover order is then defined
    order = list(range(len(tensors)))
    rng.shuffle(order)
    limits = rng.choice([[MIB, 25 * MIB], [4096], [1000, 50000]])
    expected, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], limits, [], order)
    assert plan_rebuilt(*sizes_and_keys(tensors), limits, order) == expected


def test_limits_policy():
    # DDP: one unbounded bucket in the first iteration when the buckets will be rebuilt after it
    # (torch's needs_rebuild = static_graph or not find_unused_parameters).
    assert bucket_limits(None, True, needs_rebuild=True) == [UNBOUNDED]
    assert bucket_limits(None, True, needs_rebuild=False) == [MIB, 25 * MIB]
    # Rebuilt: 1 MiB first bucket only when bucket_cap_mb was left at its default.
    assert bucket_limits(None, False, needs_rebuild=True) == [MIB, 25 * MIB]
    assert bucket_limits(5, False, needs_rebuild=True) == [5 * MIB]
    assert bucket_limits(0.5, False, needs_rebuild=False) == [MIB // 2]


def test_initial_plan_is_reversed_with_registration_order_inside():
    sizes, keys = [400] * 6, ["f32"] * 6
    assert plan_initial(sizes, keys, [1000]) == [[3, 4, 5], [0, 1, 2]]
    assert plan_initial(sizes, keys, [UNBOUNDED]) == [[0, 1, 2, 3, 4, 5]]


def test_groups_never_share_a_bucket():
    plan = plan_initial([8, 8, 8, 8], ["a", "b", "a", "b"], [UNBOUNDED])
    assert plan == [[1, 3], [0, 2]]


@pytest.mark.parametrize("bad", [[], [-1], [100, -1]])
def test_bad_limits(bad):
    with pytest.raises(ValueError, match="limits="):
        assign_buckets([4], ["a"], bad)


def test_zero_limit_gives_each_tensor_its_own_bucket():  # bucket_cap_mb=0, as torch DDP does
    assert assign_buckets([4, 0, 8], ["a", "a", "a"], [0]) == [[0], [1], [2]]


def test_rebuilt_order_must_be_a_permutation():
    with pytest.raises(ValueError, match="ready_order"):
        plan_rebuilt([4, 4], ["a", "a"], [100], [0, 0])
