"""Paths given to edgelin: one that cannot name a file is refused, and every output path is checked before any
work starts (its names fit the file system, its folder exists or can be made and is writable). Standard library only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from edgelin.errors import OutputError, RuntimeInputError
from edgelin.runtime.files.replace import Recogniser, check_replace


def check_path(path: Any, what: str, error: type = RuntimeInputError) -> Path:
    """``path`` as a Path if it can name a file: text or an os.PathLike, not empty, without a NUL character (which no
    file name holds). Otherwise ``error`` (an EdgelinError class) with one line: ``None`` or a number passed for a path,
    or a name with a NUL, would escape as TypeError / ValueError from deep inside."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise error(f"the {what} must be a path (text or a pathlib.Path), got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise error(f"the {what} must be a path (text or a pathlib.Path), got a {type(path).__name__} of {type(text).__name__}")
    if "\x00" in text:
        raise error(f"the {what} {text!r} holds a NUL character, which no file name can; name another")
    if not text:
        raise error(f"the {what} path is empty; name one")
    return Path(text)


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (the folder new folders would be created in)."""
    path = Path(os.path.abspath(path))
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # e.g. a name too long for the file system: nothing of that name can exist
        return False


# what a temporary sibling adds to a name at most: ".{name}.{kind}.{pid}.{8 hex}" (temp_dir: kind 3 letters, a pid of
# up to 7 digits) and ".{name}.{8 hex}.tmp" (atomic_write)
TEMP_NAME_EXTRA = 22


def check_name_lengths(path: str | os.PathLike, what: str) -> None:
    """Refuse, before any work, a path whose new names the file system cannot hold: each name of at most the folder's
    NAME_MAX bytes (255 on most), the last one with room for the temporary sibling edgelin writes first. OutputError."""
    path = Path(os.path.abspath(path))
    base = nearest_existing(path)
    try:
        limit = os.pathconf(base if base.is_dir() else base.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    new = path.relative_to(base).parts if path != base else ()
    names = list(new) if new else [path.name]
    for i, name in enumerate(names):
        last = i == len(names) - 1
        room = limit - (TEMP_NAME_EXTRA if last else 0)
        size = len(os.fsencode(name))
        if size > room:
            raise OutputError(
                f"cannot write the {what} {str(path)[:60]}...: the name {name[:20]!r}... is {size} bytes, and this file system "
                f"holds names of at most {limit} bytes" + (f" ({room} for this one, with room for edgelin's temporary copy)" if last else "")
                + "; choose a shorter name"
            )


def check_writable_folder(folder: Path, path: Path, what: str) -> None:
    if not folder.is_dir():
        raise OutputError(f"cannot write the {what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the {what} {path}: folder {folder} is not writable")


def check_output_file(
    path: str | os.PathLike, what: str = "output file", *, create_parents: bool = False, overwrite: bool = False,
    ours: Recogniser | None = None,
) -> Path:
    """Check, before any work, that ``path`` can be written as a file: not empty, not a folder, its
    folder exists (or, with ``create_parents``, can be created) and is writable, and an existing file
    may be replaced (``check_replace``). Raises OutputError."""
    if isinstance(path, (str, os.PathLike)) and str(path) == "":
        raise OutputError(f"the {what} path is empty; name a file")
    path = check_path(path, what, OutputError)
    check_name_lengths(path, what)
    check_replace(path, what, overwrite=overwrite, ours=ours)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.exists() and not create_parents:
        raise OutputError(f"cannot write the {what} {path}: its folder does not exist ({folder}); create it first")
    check_writable_folder(nearest_existing(folder), path, what)
    return path


def check_output_folder(path: str | os.PathLike, what: str = "output folder") -> Path:
    """Check, before any work, that files can later be written into the folder ``path`` (existing, or
    creatable in its closest existing ancestor). Nothing is created here. Raises OutputError."""
    if isinstance(path, (str, os.PathLike)) and str(path) == "":
        raise OutputError(f"the {what} path is empty; name a folder")
    path = check_path(path, what, OutputError)
    check_name_lengths(path, what)
    if path.exists() and not path.is_dir():
        raise OutputError(f"the {what} {path} exists and is not a folder; choose another path")
    check_writable_folder(nearest_existing(path), path, what)
    return path
