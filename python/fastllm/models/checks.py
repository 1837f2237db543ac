"""Checks of the values a model's config gives: each returns the value, or raises a TypeError
(a value of the wrong kind) or ValueError (out of bounds) naming it."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["brief", "check_bool", "check_int", "check_positive_number"]


def check_int(name: str, value: Any, high: int, *, low: int = 1) -> int:
    """``value``, if it is an int in ``[low, high]``; else a TypeError (not an int: a bool, a
    float, a string) or a ValueError (out of bounds) naming ``name`` and the value."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int in [{low}, {high}], got {brief(value)}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value}")
    return value


def check_positive_number(name: str, value: Any) -> float:
    """``value``, if it is a finite int or float > 0; else a TypeError or ValueError."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a positive number, got {brief(value)}")
    if not 0 < value <= sys.float_info.max:  # False for NaN and inf; exact for huge ints
        raise ValueError(f"{name} must be a positive number, got {brief(value)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value``, if it is a bool: JSON's ``"false"`` is a string, and truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {brief(value)}")
    return value


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a config may hold long lists)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
