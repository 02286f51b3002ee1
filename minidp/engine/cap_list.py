"""bucket_cap_mb_list: the byte limits the planner walks, given by the user as a list of MiB.

What it changes in the core: only the limits the layout plans with (planning.assign_buckets walks a
list of limits, each (dtype, device) group moving to the next limit when a bucket closes and
staying on the last). torch DDP >= 2.14 (`_BucketCapacityConfig`, `Reducer::rebuild_buckets`):
  * the list is used as it is, in MiB times 2**20 rounded down to bytes, for the plan made at
    construction *and* for the rebuilt one: unlike the default, the first iteration is bucketed
    (no single unbounded bucket), and the buckets are still rebuilt in ready order after it when
    find_unused_parameters=False (or static_graph=True);
  * bucket_cap_mb is then ignored; the cap torch reports (bucket_bytes_cap) is the list's largest;
  * an empty list means no list (torch tests it for truth).
"""
from __future__ import annotations

import math

from ..validate import check_number
from .planning import MIB


def check_cap_list(value, bucket_cap_mb) -> list | None:
    """The list as given (None for None or empty), else TypeError/ValueError naming the value."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"bucket_cap_mb_list={value!r} must be a list of bucket caps in MiB, or None")
    if not value:
        return None  # torch DDP: `if bucket_cap_mb_list:`, so [] is the default
    for cap in value:
        check_number("bucket_cap_mb_list's element", cap, low=0)
        if not math.isfinite(cap):
            raise ValueError(f"bucket_cap_mb_list={value!r}: every cap must be finite (MiB)")
    if bucket_cap_mb == "auto":
        raise ValueError(f"bucket_cap_mb=\"auto\" and bucket_cap_mb_list={value!r} cannot be used "
                         "together: the list fixes the caps; pass one of them")
    return list(value)


def limits_of(caps_mb: list, cap, first_iteration: bool, needs_rebuild: bool) -> list[int]:
    """planning.bucket_limits' signature: the list's bytes for every plan, whatever the other args."""
    return [int(mb * MIB) for mb in caps_mb]
