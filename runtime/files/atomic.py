"""Writing one file so that a reader never sees half of it: a temporary file beside it, fsync, a rename; and JSON
written that way. Standard library only."""

from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable

from edgelin.errors import OutputError
from edgelin.runtime.files.replace import Recogniser, check_replace, json_format


def create_fresh(parent: Path, prefix: str, suffix: str, create: Callable[[Path], object]):
    """(path, create(path)) for a new name ``parent/{prefix}xxxxxxxx{suffix}``. Files and folders are created
    with mode 0666 / 0777 and the kernel applies the umask: ordinary permissions, and no process-global
    umask is read or changed (that would race with other threads)."""
    for _ in range(100):
        path = parent / f"{prefix}{secrets.token_hex(4)}{suffix}"
        try:
            return path, create(path)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent}")


def atomic_write(
    path: str | os.PathLike, write: Callable[[BinaryIO], None], *, overwrite: bool = False, ours: Recogniser | None = None,
    what: str = "output file",
) -> Path:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    An existing ``path`` is replaced only as ``check_replace`` allows (checked first, and again just
    before the rename). On any failure the temporary file is removed and ``path`` is untouched; a failure
    of the file system (read-only folder, disk full) raises ``OutputError`` with one line.
    """
    path = Path(path)
    check_replace(path, what, overwrite=overwrite, ours=ours)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        tmp, fd = create_fresh(parent, f".{path.name}.", ".tmp", lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; nothing was written") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        check_replace(path, what, overwrite=overwrite, ours=ours)  # it may have appeared while writing
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OutputError):
            raise
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}; {path} was left as it was") from None
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
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):  # a numpy scalar (no numpy import needed)
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    return obj


def write_json(
    path: str | os.PathLike, obj: Any, *, indent: int = 2, overwrite: bool = False, ours: Recogniser | None = None,
    what: str = "output file",
) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (``atomic_write``, which says when an existing file may
    be replaced: by default one whose ``format`` is ``obj``'s own); non-finite numbers become null, so the
    file is valid JSON (``allow_nan=False``) whatever the numbers."""
    if ours is None and isinstance(obj, dict) and isinstance(obj.get("format"), str) and "/" in obj["format"]:
        ours = json_format(obj["format"].rsplit("/", 1)[0] + "/")
    text = json.dumps(json_ready(obj), indent=indent, allow_nan=False) + "\n"
    return atomic_write(path, lambda f: f.write(text.encode("utf-8")), overwrite=overwrite, ours=ours, what=what)
