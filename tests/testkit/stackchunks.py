"""Keep CPython 3.11's frame-stack chunks from being mapped and unmapped on every call (test processes only).

CPython 3.11 and 3.12 map a fresh 16 KiB chunk of frame stack whenever a call does not fit the current one and
unmap it when the call returns (CPython gh-142183; the fix, keeping one chunk, went into 3.13 and 3.14 in 2026).
A loop that calls right at a chunk's edge then pays an mmap, a munmap and a page fault per call. torch.onnx's
tracing and fla's kernels in Triton's interpreter hit that edge: measured on the 2-core machine, the xdist workers
spent nearly as much time in the kernel as in Python (``strace -c``: ~20,000 mmap/munmap pairs a second), and
tests/importers/test_fla_parity.py took 2 min 24 s on two workers against 1 min 31 s with this cache; one tiny
delta-rule export 23.3 s against 17.2 s.

``install()`` compiles stackchunks.c (a cache of freed blocks in front of mmap, installed with CPython's
``PyObject_SetArenaAllocator``) with the machine's C compiler and installs it in this process. Nothing a test
checks depends on it: it changes where CPython's arenas and frame chunks come from, not what runs. Without a C
compiler, or on another Python implementation, it does nothing and says why.

Only the test processes (the controller and xdist's workers) get it: the Python processes the tests start (the
CLI, the frameworks' oracle runs, the bench's workers) were measured with it too (through a sitecustomize) and were
no faster: tests/importers/test_upstream.py and tests/test_bench.py took 3 min 50 s with it, 3 min 38 s without.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("stackchunks.c")


class _Allocator(ctypes.Structure):  # PyObjectArenaAllocator
    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


_LIB: ctypes.CDLL | None = None
_STATUS = "not installed"


def _compiler() -> str | None:
    configured = (sysconfig.get_config_var("CC") or "").split()
    for name in ([configured[0]] if configured else []) + ["cc", "gcc", "clang"]:
        if shutil.which(name):
            return name
    return None


def install() -> str:
    """Install the cache in this process (once); returns a line saying what was done."""
    global _LIB, _STATUS
    if _STATUS != "not installed":  # installed, or found not to be, already
        return _STATUS
    if platform.python_implementation() != "CPython" or sys.version_info < (3, 11) or os.name != "posix":
        _STATUS = f"frame-stack chunk cache: not needed on {platform.python_implementation()} {platform.python_version()}"
        return _STATUS
    cc = _compiler()
    if cc is None:
        _STATUS = "frame-stack chunk cache: off (no C compiler found; the suite runs, slower on CPython 3.11/3.12)"
        return _STATUS
    folder = Path(tempfile.mkdtemp(prefix="edgelin-stackchunks-"))
    try:
        lib = folder / "stackchunks.so"
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            _STATUS = f"frame-stack chunk cache: off ({cc} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]})"
            return _STATUS
        _LIB = ctypes.CDLL(str(lib))  # stays mapped after its file is removed
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    allocator = _Allocator()
    _LIB.stackchunks_fill(ctypes.byref(allocator))
    ctypes.pythonapi.PyObject_SetArenaAllocator(ctypes.byref(allocator))  # CPython copies the struct
    _STATUS = f"frame-stack chunk cache: on (CPython {platform.python_version()}, gh-142183)"
    return _STATUS


def counts() -> tuple[int, int] | None:
    """(blocks handed out again from the cache, blocks mapped) since install, or None when not installed."""
    if _LIB is None:
        return None
    _LIB.stackchunks_hits.restype = _LIB.stackchunks_maps.restype = ctypes.c_ulonglong
    return int(_LIB.stackchunks_hits()), int(_LIB.stackchunks_maps())


def installed() -> bool:
    """Whether CPython's arena allocator in this process is this cache's."""
    if _LIB is None:
        return False
    current = _Allocator()
    ctypes.pythonapi.PyObject_GetArenaAllocator(ctypes.byref(current))
    mine = _Allocator()
    _LIB.stackchunks_fill(ctypes.byref(mine))
    return (current.alloc, current.free) == (mine.alloc, mine.free)


__all__ = ["counts", "install", "installed"]
