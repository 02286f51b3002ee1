"""DDP's bucket layout rules: which parameters share one all-reduce buffer. No group, no tensor.

The rules reproduce torch DDP's (`compute_bucket_assignment_by_size`), so that a bucket holds the
same gradients at the same offsets as DDP's: bitwise equality at 3+ ranks needs it, since gloo's
ring sums an element in an order that depends on where it sits in the buffer.
  * walk the parameters in order, grouped by (dtype, device); each group fills a bucket until its
    bytes reach the current limit (>=: a bucket may pass it by one tensor), then moves on to the
    next limit of the list (staying on the last); a sparse gradient gets a bucket of its own;
  * at construction: registration order, buckets sorted by their smallest index, then reversed
    (the last-defined parameters' gradients arrive first);
  * after the first iteration: the order in which gradients became ready; not sorted or reversed.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable, Sequence

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
UNBOUNDED = sys.maxsize


def bucket_limits(bucket_cap_mb: float | None, first_iteration: bool,
                  needs_rebuild: bool) -> list[int]:
    """The list of byte limits DDP walks for one plan.

    Args:
        bucket_cap_mb: the user's cap in MiB; None: DDP's default (25 MiB, the first bucket 1 MiB).
        first_iteration: True for the plan made at construction, False for the rebuilt one.
        needs_rebuild: torch's `static_graph or not find_unused_parameters`: rebuilt in ready order.
    """
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
    first_cap = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    if first_iteration and needs_rebuild:
        # The real backward order is unknown yet: reduce everything at the end, in one bucket.
        return [UNBOUNDED]
    return [first_cap, cap] if first_cap < cap else [cap]


def assign_buckets(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                   order: Sequence[int] | None = None,
                   sparse: Sequence[bool] = ()) -> list[list[int]]:
    """Cut tensors into buckets by byte size; DDP's compute_bucket_assignment_by_size.

    Args:
        sizes: byte size of each tensor (numel * element_size). keys: a group key per tensor,
            e.g. (dtype, device); groups never share a bucket. limits: byte limits, per group.
        order: tensor indices in walking order. Default: 0, 1, 2, ..., the buckets sorted (DDP's).
        sparse: by tensor, whether its gradient is sparse (a bucket of its own). Default: none is.
    Returns:
        A list of buckets, each a list of tensor indices in the order walked.
    """
    if not limits or any(limit < 0 for limit in limits):  # 0: every tensor closes its bucket
        raise ValueError(f"limits={list(limits)} must be a non-empty list of byte sizes >= 0")
    walk = range(len(sizes)) if order is None else order
    open_buckets: OrderedDict = OrderedDict()  # key -> [indices, bytes]; first-seen key first
    limit_pos: dict = {}
    result = []
    for index in walk:
        if sparse and sparse[index]:
            result.append([index])
            continue
        key = keys[index]
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(index)
        bucket[1] += sizes[index]
        pos = limit_pos.setdefault(key, 0)
        if bucket[1] >= limits[pos]:
            result.append(bucket[0])
            open_buckets[key] = [[], 0]
            limit_pos[key] = min(pos + 1, len(limits) - 1)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    if order is None:
        result.sort(key=min)
    return result


def plan_initial(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The construction-time plan: registration order, buckets reversed (last layers first)."""
    return list(reversed(assign_buckets(sizes, keys, limits, sparse=sparse)))


def plan_rebuilt(sizes: Sequence[int], keys: Sequence[Hashable], limits: Sequence[int],
                 ready_order: Sequence[int], sparse: Sequence[bool] = ()) -> list[list[int]]:
    """The plan after the first iteration: the order in which gradients became ready."""
    if sorted(ready_order) != list(range(len(sizes))):
        raise ValueError(f"ready_order={list(ready_order)} must be a permutation of "
                         f"0..{len(sizes) - 1}")
    return assign_buckets(sizes, keys, limits, order=ready_order, sparse=sparse)
