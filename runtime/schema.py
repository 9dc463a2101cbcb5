"""The JSON Schema of the manifest (``schema/edgelin-2.schema.json``, draft 2020-12) and a small validator.

The validator implements the part of JSON Schema that the schema uses -- ``type``, ``enum``, ``properties``,
``required``, ``additionalProperties``, ``items``, ``minItems``, ``maxItems``, ``minimum``, ``maximum``,
``pattern`` and ``$ref`` into ``$defs`` -- with JSON Schema's meaning (a number with no fraction part is an
``integer``; true/false are not numbers; ``enum`` compares JSON values, so 1 is not true). Any other
keyword in a schema it is given is refused, so the schema cannot silently outgrow it. Standard library only.

    errors = validate(instance)        # [] or ["at states[0].dtype: 'float64' is not one of ..."]
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parent / "schema" / "edgelin-2.schema.json"
ANNOTATIONS = {"$schema", "$id", "title", "description", "$defs"}
KEYWORDS = {
    "type", "enum", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minimum", "maximum", "pattern", "$ref",
} | ANNOTATIONS
MAX_ERRORS = 5


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The manifest schema, read once from the package."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def _is_type(x: Any, kind: str) -> bool:
    if kind == "null":
        return x is None
    if kind == "boolean":
        return isinstance(x, bool)
    if kind == "object":
        return isinstance(x, dict)
    if kind == "array":
        return isinstance(x, list)
    if kind == "string":
        return isinstance(x, str)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    if kind == "number":
        return True
    if kind == "integer":
        return isinstance(x, int) or x.is_integer()
    raise ValueError(f"unknown JSON Schema type {kind!r}")


def json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: true is not 1, 1.0 is 1, objects compare by content."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern:
    # ECMA-262 '$' (no multiline flag) matches only at the very end; Python's also before a final newline
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _short(x: Any, limit: int = 50) -> str:
    text = json.dumps(x, ensure_ascii=True) if not isinstance(x, float) or x == x else repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(path: str) -> str:
    return f"at {path}" if path else "at the top level"


def validate(instance: Any, root: dict[str, Any] | None = None) -> list[str]:
    """Every way ``instance`` breaks the schema (at most a few), as one-line messages; [] if it is valid."""
    root = schema() if root is None else root
    errors: list[str] = []
    _check(instance, root, root, "", errors)
    return errors


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in root.get("$defs", {}):
        raise ValueError(f"unsupported $ref {ref!r}: only '#/$defs/NAME'")
    return root["$defs"][ref[len(prefix):]]


def _check(x: Any, s: dict[str, Any], root: dict[str, Any], path: str, errors: list[str]) -> None:
    if len(errors) >= MAX_ERRORS:
        return
    unknown = set(s) - KEYWORDS
    if unknown:
        raise ValueError(f"the schema uses {sorted(unknown)}, which this validator does not implement")
    if "$ref" in s:
        _check(x, _resolve(s["$ref"], root), root, path, errors)
    if "type" in s:
        kinds = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_is_type(x, k) for k in kinds):
            errors.append(f"{_where(path)}: {_short(x)} is not {' or '.join(kinds)}")
            return
    if "enum" in s and not any(json_equal(x, v) for v in s["enum"]):
        errors.append(f"{_where(path)}: {_short(x)} is not one of {', '.join(_short(v) for v in s['enum'])}")
        return
    if isinstance(x, str) and "pattern" in s and not _regex(s["pattern"]).search(x):
        errors.append(f"{_where(path)}: {_short(x)} does not match {s['pattern']}")
    if _is_type(x, "number"):
        if "minimum" in s and x < s["minimum"]:
            errors.append(f"{_where(path)}: {_short(x)} is below the minimum {s['minimum']}")
        if "maximum" in s and x > s["maximum"]:
            errors.append(f"{_where(path)}: {_short(x)} is above the maximum {s['maximum']}")
    if isinstance(x, list):
        if "minItems" in s and len(x) < s["minItems"]:
            errors.append(f"{_where(path)}: has {len(x)} item(s), at least {s['minItems']} needed")
        if "maxItems" in s and len(x) > s["maxItems"]:
            errors.append(f"{_where(path)}: has {len(x)} item(s), at most {s['maxItems']} allowed")
        if "items" in s:
            for i, item in enumerate(x):
                _check(item, s["items"], root, f"{path}[{i}]", errors)
    if isinstance(x, dict):
        missing = [k for k in s.get("required", ()) if k not in x]
        if missing:
            errors.append(f"{_where(path)}: missing {', '.join(missing)}")
        props = s.get("properties", {})
        for key, value in x.items():
            sub = f"{path}.{key}" if path else str(key)
            if key in props:
                _check(value, props[key], root, sub, errors)
            elif s.get("additionalProperties", True) is False:
                errors.append(f"{_where(path)}: unknown field {_short(key)}")
            elif isinstance(s.get("additionalProperties"), dict):
                _check(value, s["additionalProperties"], root, sub, errors)


__all__ = ["SCHEMA_FILE", "json_equal", "schema", "validate"]
