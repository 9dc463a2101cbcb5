"""Checking numeric options at a public boundary, in one place. Standard library + numpy only.

    check_int("top_k", k, low=0, hint="0 = off")              -> int, or error_type with one line
    check_number("temperature", t, low=0, high=100)            -> float (finite), or error_type
    token_array(ids, "prompt 0", vocab_size)                   -> ids as a numpy array, or RuntimeInputError

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


def _where(index: tuple[int, ...]) -> str:
    return f"position {index[-1]}" + (f" (sequence {index[0]})" if len(index) == 2 else "") if index else "position 0"


def token_array(value: Any, what: str, vocab_size: int | None = None, ragged: str | None = None) -> np.ndarray:
    """Token ids (a sequence, nested sequences or an array) as a numpy array of any shape, refusing in one line
    what numpy would read as something else: None and text or bytes (a 0-d or string array; bytes are no ids --
    decode them to text), a ragged nesting, an element that is no integer or one past int64 (an object array;
    such an id is outside any vocabulary). The caller checks the shape, the dtype of numbers and the range.
    ``ragged``: the message for a nesting numpy cannot make an array of."""
    if value is None or isinstance(value, (str, bytes, bytearray, memoryview)):
        hint = ("; bytes are no token ids: decode them to text (data.decode('utf-8')) and pass the text as the prompt"
                if isinstance(value, (bytes, bytearray, memoryview)) else
                "; text goes in as a prompt (Generator, generate_text), which the tokenizer encodes" if isinstance(value, str) else "")
        raise RuntimeInputError(f"{what} must be token ids (integers), got {type(value).__name__}{hint}")
    try:
        ids = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # numpy: a ragged nesting ([3, [4]]) is no array
        raise RuntimeInputError(ragged or f"{what} must be a flat sequence of token ids, got {str(value)[:60]}") from None
    if ids.dtype.kind in "OSUa":
        for index, x in np.ndenumerate(ids):
            if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
                if 0 <= x < 2**63:
                    continue
                vocab = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise RuntimeInputError(f"token id {x} at {_where(index)} of {what} is outside the vocabulary{vocab}")
            kind = "bytes" if isinstance(x, (bytes, np.bytes_)) else "text" if isinstance(x, str) else type(x).__name__
            hint = " (bytes are no token ids: decode them to text and pass the text as the prompt)" if kind == "bytes" else ""
            got = "None" if x is None else f"{kind} {repr(x)[:40]}"
            raise RuntimeInputError(f"{what} must hold integer token ids, got {got} at {_where(index)}{hint}")
    return ids


__all__ = ["check_int", "check_number", "token_array"]
