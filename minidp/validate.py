"""Argument checks shared by the public API: errors name the argument and the value."""
from __future__ import annotations


def check_int(name: str, value, low: int) -> int:
    """`value` as an int >= `low`, or TypeError/ValueError naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an int")
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    return value
