"""Backward's default prefetch: the order in which this step's forwards ended (FSDP2's
post_forward_order and each group's _post_forward_indices).

Backward runs the units in the reverse of their forwards, so while one unit computes its backward,
the unit to gather next is the one whose forward ended just before its own: ForwardOrder records
that order in forward and, in backward, gives each unit its prefetch target.
"""
from __future__ import annotations


class ForwardOrder:
    """The units in the order their forwards ended this step, shared by the units of one root."""

    def __init__(self):
        self.units: list = []  # a unit run twice in one forward is here twice
        self.positions: dict = {}  # unit -> its places in `units` whose backward has not begun

    def record(self, unit) -> None:
        """`unit`'s forward has ended (with grad enabled: a backward will follow)."""
        self.positions.setdefault(unit, []).append(len(self.units))
        self.units.append(unit)

    def pop_previous(self, unit) -> list:
        """As `unit`'s backward begins: the unit whose forward ended just before `unit`'s last one
        not yet backwarded ([] for the first unit, or a unit not recorded), to gather next."""
        places = self.positions.get(unit)
        index = places.pop() if places else 0
        return [self.units[index - 1]] if index > 0 else []

    def clear(self) -> None:
        """At the end of backward: the next step records its own order."""
        self.units.clear()
        self.positions.clear()
