"""May an existing file be replaced? The one rule for every file edgelin writes (``check_replace``), and the
recognisers that tell a file edgelin wrote from anyone else's: by content, never by name. Standard library only."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Callable

from edgelin.errors import OutputError
from edgelin.runtime.files.reading import read_regular

MANIFEST_FILE = "edgelin.json"  # also runtime.manifest.MANIFEST_FILE (that package imports numpy; this one must not)
OVERWRITE_HINT = "pass --force (overwrite=True in Python) to replace it, or name another file"
MAX_RECOGNISED_BYTES = 64 << 20  # a file edgelin recognises as its own is read only up to this size

Recogniser = Callable[[Path], bool]  # True if the (regular, existing) file at the path is one edgelin wrote


def _json_object(path: Path, what: str) -> dict | None:
    """The JSON object a small regular file holds, or None (unreadable, too large, not JSON, not an object)."""
    data = read_regular(path, MAX_RECOGNISED_BYTES, what=what, quiet=True)
    if data is None:
        return None
    try:
        d = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


def json_format(prefix: str, kind: str | None = None) -> Recogniser:
    """Recognises a JSON file whose top-level ``format`` is a string starting with ``prefix`` (at most
    MAX_RECOGNISED_BYTES; anything unreadable is not recognised)."""

    def ours(path: Path) -> bool:
        d = _json_object(path, "file")
        return d is not None and isinstance(d.get("format"), str) and d["format"].startswith(prefix)

    ours.kind = kind or f"a file edgelin wrote (JSON of format {prefix}*)"  # type: ignore[attr-defined]
    return ours


def png_text(keyword: str, prefix: str, kind: str) -> Recogniser:
    """Recognises a PNG file whose text chunk ``keyword`` (before the image data) starts with ``prefix``:
    how the bench's plots, written with ``metadata={keyword: ...}``, are told from anyone else's PNGs."""
    want = keyword.encode("latin-1") + b"\0"

    def ours(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                if f.read(8) != b"\x89PNG\r\n\x1a\n":
                    return False
                for _ in range(64):
                    head = f.read(8)
                    if len(head) < 8:
                        return False
                    size, kind_ = int.from_bytes(head[:4], "big"), head[4:]
                    if kind_ in (b"IDAT", b"IEND") or size > 1 << 20:
                        return False
                    data = f.read(size)
                    f.read(4)  # crc
                    if kind_ == b"tEXt" and data.startswith(want):
                        return data[len(want):].decode("latin-1").startswith(prefix)
        except OSError:
            return False
        return False

    ours.kind = kind  # type: ignore[attr-defined]
    return ours


def export_holding(path: Path) -> Path | None:
    """The export folder ``path`` is part of (its ``edgelin.json``, a graph or tokenizer file the manifest
    names, or an ``.onnx`` / ``.data`` file beside an edgelin manifest), else None."""
    folder = path.parent if str(path.parent) else Path(".")
    d = _json_object(folder / MANIFEST_FILE, "manifest")
    if d is None or not isinstance(d.get("format"), str) or not d["format"].startswith("edgelin/"):
        return None
    names = {MANIFEST_FILE}
    graphs, tok = d.get("graphs"), d.get("tokenizer")
    if isinstance(graphs, dict):
        names |= {v for v in graphs.values() if isinstance(v, str)}
    if isinstance(tok, dict) and isinstance(tok.get("files"), dict):
        names |= {k for k in tok["files"] if isinstance(k, str)}
    if isinstance(d.get("weights"), dict) and isinstance(d["weights"].get("file"), str):
        names.add(d["weights"]["file"])
    if isinstance(d.get("golden"), dict) and isinstance(d["golden"].get("file"), str):
        names.add(d["golden"]["file"])
    if path.name in names or path.name.endswith((".onnx", ".data")):
        return folder
    return None


def check_replace(path: str | os.PathLike, what: str = "output file", *, overwrite: bool = False, ours: Recogniser | None = None) -> bool:
    """May a file be written at ``path``? The one rule for every file edgelin writes:

    - nothing there: yes;
    - a folder, a symbolic link, a FIFO, a device or a socket: never (OutputError);
    - a regular file that is part of an edgelin export (``export_holding``): only with ``overwrite``;
    - any other regular file: if ``ours`` recognises it as a file edgelin wrote of this kind, or with ``overwrite``.

    Returns True if a file will be replaced. Raises OutputError (one line, naming the file and what to do).
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # nothing there (the folder checks say why it cannot be made)
        return False
    except OSError as exc:
        raise OutputError(f"cannot write the {what} {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(f"the {what} {path} is a symbolic link; name the file itself or another file")
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(f"the {what} {path} is a folder; name a file")
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"the {what} {path} exists and is not a regular file; name another file")
    if overwrite:
        return True
    export = export_holding(path)
    if export is not None:
        raise OutputError(f"the {what} {path} is part of the edgelin export {export}; {OVERWRITE_HINT}")
    if ours is None or not ours(path):
        kind = getattr(ours, "kind", None)
        why = f"it is not {kind}" if kind else "edgelin did not write it"
        raise OutputError(f"the {what} {path} already exists and {why}; {OVERWRITE_HINT}")
    return True
