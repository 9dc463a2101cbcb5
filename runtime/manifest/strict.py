"""Strict reading of manifest JSON: NaN, Infinity and stack-deep nesting refused, and the small checks every reader
of a field shares (names, dims, plain file names, values that fit a dtype), with short descriptions of what was
found instead. Standard library + numpy only."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from edgelin.errors import ManifestError
from edgelin.runtime.manifest.format import DTYPES, MANIFEST_FILE, MAX_DIM


def json_int(x: Any) -> int:
    """A JSON integer (the schema already said so): 4.0 is 4."""
    return int(x) if not isinstance(x, str) else x


def kind_of(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}.get(type(x), type(x).__name__)


def short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def name_ok(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 256 and "\x00" not in x


def dim_ok(x: Any) -> bool:
    if isinstance(x, str):
        return name_ok(x)
    return not isinstance(x, bool) and isinstance(x, int) and 1 <= x <= MAX_DIM


def plain_file_name(name: Any) -> bool:
    """A file name with no folder part: not empty, not '.' or '..', no '/' or '\\', no NUL."""
    return (
        isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
        and not any(c in name for c in ("/", "\\", "\x00")) and not os.path.isabs(name)
    )


def fits(value: float, dtype: str) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(value, dtype=DTYPES[dtype])))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: Any, where: str = MANIFEST_FILE) -> Any:
    """Strict JSON: NaN / Infinity are refused, so are nesting deep enough to exhaust the stack."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    if not isinstance(text, str):
        raise ManifestError(f"{where} must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where} is not valid JSON ({exc})") from None
    except ValueError as exc:
        raise ManifestError(f"{where} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ManifestError(f"{where} is nested too deeply to be a manifest") from None


def canonical_json(text: str, where: str = MANIFEST_FILE) -> str:
    """The manifest's content in one canonical form (sorted keys, no insignificant space)."""
    return json.dumps(parse_json(text, where), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_manifest_equal(a_text: str, b_text: str) -> bool:
    """True if two manifest texts hold the same JSON content, whatever their indentation or key order.
    Text that is not valid JSON equals nothing."""
    try:
        return canonical_json(a_text) == canonical_json(b_text)
    except ManifestError:
        return False
