"""A folder tree as data, to show that a command changed nothing."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def tree(root: Path) -> dict[str, str]:
    """Every path under root -> 'dir', 'link -> target', 'special' (a FIFO, a device) or the sha256 of the file;
    files over 64 MiB (sparse giants) by size and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"link -> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            elif not p.is_file():
                out[rel] = "special"
            elif p.stat().st_size > 64 << 20:
                out[rel] = f"{p.stat().st_size} bytes, mtime {p.stat().st_mtime_ns}"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
