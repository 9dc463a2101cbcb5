"""Writing files so that a reader never sees half of one. Standard library only.

New files and folders get the ordinary permissions of the user's umask (0666 / 0777 minus it): they are
created with those modes and the kernel applies the umask, so no process-global umask is read or changed.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import BinaryIO, Callable


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


__all__ = ["atomic_write", "temp_dir"]
