"""Argument checks shared by the public API: errors name the argument and the value.

One rule everywhere: a value of the wrong *type* raises TypeError, a value of the right type
outside its range raises ValueError. bool is never accepted where a number is meant
(`isinstance(True, int)` is True in Python, so each check excludes it explicitly).
"""
from __future__ import annotations

import numbers


def check_int(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int in [low, high] (either bound optional), else TypeError/ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    value = int(value)
    if low is not None and value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value} must be <= {high}")
    return value


def check_number(name: str, value, positive: bool = False, low: float | None = None,
                 high: float | None = None) -> float:
    """`value` as a real number (int or float, not bool), optionally > 0 or within [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number")
    if value != value:  # NaN fails every comparison below silently
        raise ValueError(f"{name}={value!r} must not be NaN")
    if positive and not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0")
    if low is not None and value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value!r} must be <= {high}")
    return value


def check_bool(name: str, value) -> bool:
    """`value` if it is True or False, else TypeError naming `name` (1 and "yes" are refused too)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
    return value


def check_choice(name: str, value, choices) -> object:
    """`value` if it is one of `choices`: TypeError if it is not even of a choice's type, else ValueError."""
    listed = ", ".join(map(repr, choices))
    if not any(isinstance(value, type(c)) for c in choices):  # rule=["sqrt"], epoch_mode=3
        raise TypeError(f"{name}={value!r} must be one of {listed}")
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {listed}")
    return value
