"""Reading a file edgelin is given: only a regular file, only up to a bounded size. Standard library only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from edgelin.errors import RuntimeInputError


def regular_file(path: str | os.PathLike, limit: int, what: str = "file") -> Path:
    """``path`` if it is a regular file (after symbolic links) of at most ``limit`` bytes, checked before
    anything opens it: a FIFO or a device would block or never end. Raises RuntimeInputError (one line)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise RuntimeInputError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise RuntimeInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise RuntimeInputError(f"{what} {path} is a folder; name a file")
    if not stat.S_ISREG(st.st_mode):
        raise RuntimeInputError(f"{what} {path} is not a regular file (a FIFO, device or socket is never read); name a file")
    if st.st_size > limit:
        raise RuntimeInputError(f"{what} {path} is {st.st_size:,} bytes, more than the {limit:,} it can be; name the right file")
    return path


def read_regular(path: str | os.PathLike, limit: int, what: str = "file", *, quiet: bool = False) -> bytes | None:
    """The bytes of the regular file ``path`` (``regular_file``), opened without blocking on a FIFO that
    appears after the check (O_NONBLOCK) and read up to ``limit`` bytes. With ``quiet``, None instead of an error."""
    try:
        path = regular_file(path, limit, what)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else after the check
                raise RuntimeInputError(f"{what} {path} is not a regular file; name a file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(limit + 1)
        finally:
            os.close(fd)
    except (RuntimeInputError, OSError) as exc:
        if quiet:
            return None
        if isinstance(exc, RuntimeInputError):
            raise
        raise RuntimeInputError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        if quiet:
            return None
        raise RuntimeInputError(f"{what} {path} is more than {limit:,} bytes; name the right file")
    return data
