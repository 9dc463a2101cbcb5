"""When a write fails: what stopped it, said as the system says it, and the cleanup after it, which a second
Ctrl-C must not cut short. Standard library only."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from pathlib import Path

from edgelin.runtime.files.paths import nearest_existing


@contextlib.contextmanager
def uninterrupted():
    """Run the block with Ctrl-C (SIGINT), SIGTERM and SIGHUP ignored: the removal of a half-written folder after the
    first Ctrl-C, which a second one would otherwise stop half way. Only in the main thread (where handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large",
               getattr(errno, "EDQUOT", errno.ENOSPC): "disk quota exceeded"}
NEAR_FULL = 1 << 20  # free bytes under which a write error without a reason is put down to a full file system


def write_failure(exc: BaseException, folder: str | os.PathLike) -> str | None:
    """What stopped a write into ``folder``, said as the system says it ("no space left on device", "file too large
    ..."), where ``exc`` or an error it was raised from is such an OSError; None for anything else. Some writers lose
    the reason (numpy's ``tofile``, which onnx writes external data with, says only "problem writing element N"):
    then the folder's free space and the process's file-size limit (RLIMIT_FSIZE, ``ulimit -f``) are looked at,
    before anything written is removed."""
    seen, err = set(), exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            if err.errno in FULL_ERRNOS:
                return _said(err.errno, folder)
            if err.errno is None and "writing" in str(err):
                return _probe(folder)
        err = err.__cause__ or err.__context__
    return None


def _said(code: int, folder: str | os.PathLike) -> str:
    if code == errno.EFBIG:
        limit = _size_limit()
        return "file too large" + (f" (this process may write files of at most {limit:,} bytes: `ulimit -f`)" if limit is not None else "")
    free = _free_bytes(folder)
    return FULL_ERRNOS[code] + (f" ({free:,} bytes free in {nearest_existing(Path(folder))})" if free is not None else "")


def _probe(folder: str | os.PathLike) -> str | None:
    free = _free_bytes(folder)
    if free is not None and free < NEAR_FULL:
        return _said(errno.ENOSPC, folder)
    limit = _size_limit()
    if limit is not None:
        try:
            biggest = max((p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()), default=0)
        except OSError:
            biggest = 0
        if biggest >= limit - NEAR_FULL:  # the writer stops within a buffer of the limit
            return _said(errno.EFBIG, folder)
    return None


def _free_bytes(folder: str | os.PathLike) -> int | None:
    try:
        st = os.statvfs(nearest_existing(Path(folder)))
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft
