"""Writing files so that a reader never sees half of one. Standard library and numpy only.

New files and folders get the ordinary permissions of the user's umask (0666 / 0777 minus it): they are
created with those modes and the kernel applies the umask, so no process-global umask is read or changed.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

import numpy as np


def _fresh(parent: Path, prefix: str, suffix: str, create: Callable[[Path], object]):
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return path, create(path)
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot find a free temporary name in {parent}")


def temp_dir(parent: str | os.PathLike, prefix: str) -> Path:
    """A new empty folder ``parent/{prefix}XXXXXXXX`` with ordinary permissions (not mkdtemp's 0700)."""
    path, _ = _fresh(Path(parent), prefix, "", lambda p: os.mkdir(p, 0o777))
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    On any failure the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    tmp, fd = _fresh(parent, f".{path.name}.", ".tmp", lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def json_ready(obj: Any) -> Any:
    """``obj`` with numpy scalars made Python numbers, tuples made lists, and every NaN or infinity made
    None: JSON has no non-finite numbers, and a result file must stay readable when one slips in."""
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (``atomic_write``); non-finite numbers become null,
    so the file is valid JSON (``allow_nan=False``) whatever the numbers."""
    text = json.dumps(json_ready(obj), indent=indent, allow_nan=False) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")))


__all__ = ["atomic_write", "json_ready", "temp_dir", "write_json"]
