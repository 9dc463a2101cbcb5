"""Checking numeric options at a public boundary, in one place. Standard library + numpy only.

    check_int("top_k", k, low=0, hint="0 = off")              -> int, or error_type with one line
    check_number("temperature", t, low=0, high=100)            -> float (finite), or error_type

``bool`` is refused even though it is an ``int`` subclass; numpy integers are accepted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from edgelin.errors import RuntimeInputError


def _n(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:  # 1e6 reads "1,000,000", not "1,000,000.0"
        x = int(x)
    return f"{x:,}" if abs(x) >= 10_000 else f"{x}"


def _range(low: float | None, high: float | None, *, open_low: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if open_low else '['}{_n(low)}, {_n(high)}]"
    if low is not None:
        return f" {'>' if open_low else '>='} {_n(low)}"
    if high is not None:
        return f" <= {_n(high)}"
    return ""


def check_int(
    name: str, value: Any, *, low: int | None = None, high: int | None = None, hint: str = "", error: type[Exception] = RuntimeInputError
) -> int:
    """``value`` as an int in [low, high]; otherwise ``error`` naming the option, the range and the value."""
    ok = not isinstance(value, bool) and isinstance(value, (int, np.integer))
    if ok and ((low is not None and value < low) or (high is not None and value > high)):
        ok = False
    if not ok:
        kind = "a positive integer" if (low == 1 and high is None) else f"an integer{_range(low, high)}"
        raise error(f"{name} must be {kind}{f' ({hint})' if hint else ''}, got {value!r}")
    return int(value)


def check_number(
    name: str, value: Any, *, low: float | None = None, high: float | None = None, open_low: bool = False,
    hint: str = "", error: type[Exception] = RuntimeInputError,
) -> float:
    """``value`` as a finite float in the range (``open_low``: strictly above ``low``)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating)) and math.isfinite(value)
    if ok and low is not None and (value <= low if open_low else value < low):
        ok = False
    if ok and high is not None and value > high:
        ok = False
    if not ok:
        kind = "a positive number" if (low == 0 and open_low and high is None) else f"a number{_range(low, high, open_low=open_low)}"
        raise error(f"{name} must be {kind}{f' ({hint})' if hint else ''}, got {value!r}")
    return float(value)


__all__ = ["check_int", "check_number"]
