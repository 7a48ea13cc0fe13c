"""Argument checks shared by the public entry points: one place decides what an integer argument
may be (NumPy integers included, bools not), and every refusal names the argument and the value."""

from __future__ import annotations

import numbers

__all__ = ["integer"]


def integer(name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool) within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ValueError(f"{name} must be in {bounds}, got {value}")
    return value
