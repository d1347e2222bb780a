"""Strict checks of plain values read from files, flags and plugins' returns, where a bool is not a number.

JSON's ``true`` and Python's ``True`` are ints to ``isinstance`` (``True == 1``): a config field, a flag or a hook's
result that is a bool where a count or a ratio belongs would otherwise pass as 1. A leaf of the core: it imports
nothing of specframe, so every layer checks its values the one way.
"""

from __future__ import annotations

from typing import Any, TypeGuard


def is_int(value: Any, lo: int | None = None, hi: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an integer (a bool is not: JSON's ``true`` would else pass as 1) within ``lo``..``hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def is_number(value: Any) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float, not a bool (NaN and the infinities are floats: a caller that needs a
    finite number compares it)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
