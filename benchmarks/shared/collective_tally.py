"""The c10d collectives in a torch.profiler trace, tallied: calls and elements per op.

A collective's elements are its largest input's (record_shapes=True). Collectives on tensor lists
(DDP's allreduce_, ZeRO's broadcast_) record no shapes; the gloo events under them do, so their
elements are tallied apart for the caller to use instead (benchmarks/speed/zero_bytes.py,
real_models.py).
"""
from __future__ import annotations

import math

GLOO_EVENTS = ("gloo:all_reduce", "gloo:broadcast")


def numel_of(shapes) -> int:
    """Elements of a recorded shape, or of a list of them (a tensor-list argument)."""
    if not shapes:
        return 0
    if isinstance(shapes[0], list):
        return sum(numel_of(s) for s in shapes)
    return math.prod(shapes)


def tally(events) -> tuple[dict, dict, int]:
    """({c10d op: elements}, {gloo event: elements}, number of c10d collectives) of `events`
    (prof.events()); barriers are not counted."""
    whole, gloo, count = {}, dict.fromkeys(GLOO_EVENTS, 0), 0
    for event in events:
        elements = max([numel_of(s) for s in event.input_shapes] + [0])
        if event.name in gloo:
            gloo[event.name] += elements
        elif event.name.startswith("c10d::") and event.name != "c10d::barrier":
            count += 1
            whole[event.name] = whole.get(event.name, 0) + elements
    return whole, gloo, count
