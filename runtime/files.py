"""Writing files and folders so that a reader never sees half of one, and nothing edgelin did not write
is ever replaced. Standard library only.

- ``atomic_write``: one file, through a temporary file beside it and a rename. Every file edgelin writes
  goes through it, and through ``check_replace``: an existing file is replaced only if edgelin wrote it
  (recognised by its content: a JSON's ``format`` key, a state file's header, ...) and it is not part of an
  export -- otherwise only with ``overwrite=True`` (``--force``). Never a folder, a symbolic link, a FIFO
  or a device.
- ``check_output_file`` / ``check_output_dir``: every output path is checked before any work starts.
- ``replace_dir``: move a finished folder into place, replacing only what ``check_output_dir`` allowed.
- ``remove_stale_temps``: the hidden ``.NAME.tmp.PID.*`` / ``.NAME.old.PID.*`` folders an export or a site killed
  by SIGKILL leaves behind are removed by the next one to the same place: only folders that hold edgelin's work
  marker (``WORK_MARKER``, naming the folder itself, whose name holds the id of the process that made it), only
  when that process is gone, and only when they hold nothing but what edgelin writes there. A folder of the same name that lacks the
  marker is the user's, and is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import signal
import stat
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from edgelin.errors import OutputError, RuntimeInputError

MANIFEST_FILE = "edgelin.json"  # also runtime.manifest.MANIFEST_FILE (that module imports numpy; this one must not)
EXPORT_FILE_SUFFIXES = (".onnx", ".json", ".data")  # what an export (or its temporary folder) may hold
WORK_MARKER = ".edgelin-work"  # in each temporary folder while edgelin builds in it; removed before it is moved into place


def _fresh(parent: Path, prefix: str, suffix: str, create: Callable[[Path], object]):
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


# ---- may an existing file be replaced? ----------------------------------------------------------------
OVERWRITE_HINT = "pass --force (overwrite=True in Python) to replace it, or name another file"
MAX_RECOGNISED_BYTES = 64 << 20  # a file edgelin recognises as its own is read only up to this size

Recogniser = Callable[[Path], bool]  # True if the (regular, existing) file at the path is one edgelin wrote


def json_format(prefix: str, kind: str | None = None) -> Recogniser:
    """Recognises a JSON file whose top-level ``format`` is a string starting with ``prefix`` (at most
    MAX_RECOGNISED_BYTES; anything unreadable is not recognised)."""

    def ours(path: Path) -> bool:
        data = read_regular(path, MAX_RECOGNISED_BYTES, what="file", quiet=True)
        if data is None:
            return False
        try:
            d = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            return False
        return isinstance(d, dict) and isinstance(d.get("format"), str) and d["format"].startswith(prefix)

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
    data = read_regular(folder / MANIFEST_FILE, MAX_RECOGNISED_BYTES, what="manifest", quiet=True)
    if data is None:
        return None
    try:
        d = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("format"), str) or not d["format"].startswith("edgelin/"):
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


# ---- reading: only regular files, only of a bounded size -------------------------------------------
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
        tmp, fd = _fresh(parent, f".{path.name}.", ".tmp", lambda p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
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


# ---- cleanup that a second Ctrl-C must not cut short -------------------------------------------------
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


# ---- why a write failed ------------------------------------------------------------------------------
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


# ---- a path given through the API -------------------------------------------------------------------
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


# ---- checking output paths before any work -------------------------------------------------------
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


def _writable_folder(folder: Path, path: Path, what: str) -> None:
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
    _writable_folder(nearest_existing(folder), path, what)
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
    _writable_folder(nearest_existing(path), path, what)
    return path


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies inside b (both resolved)."""
    return a == b or b in a.parents


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (lowercase hex) of a file, read in 1 MiB blocks (also ``runtime.manifest.file_sha256``)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_files(folder: Path) -> list[str] | str:
    """The entries of ``folder`` if it is an export edgelin wrote and nothing changed since -- recognised by
    content, not names: an ``edgelin.json`` of edgelin's format with graph hashes (``sha256``), and every
    other entry a file it names (a graph, the weights, the golden outputs or a tokenizer file) whose sha256 is the one it records. Otherwise
    the reason, naming the first entry that is not edgelin's."""
    try:
        entries = sorted(os.listdir(folder))
    except OSError as exc:
        return f"it cannot be listed: {exc.strerror or exc}"
    data = read_regular(folder / MANIFEST_FILE, MAX_RECOGNISED_BYTES, "manifest", quiet=True)
    try:
        manifest = json.loads(data.decode("utf-8")) if data is not None else None
    except (ValueError, RecursionError):
        manifest = None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format"), str) or not manifest["format"].startswith("edgelin/"):
        return f"it holds {describe_entries(folder)} and no edgelin manifest ({MANIFEST_FILE})"
    graphs, hashes, tok = manifest.get("graphs"), manifest.get("sha256"), manifest.get("tokenizer")
    if not isinstance(graphs, dict) or not isinstance(hashes, dict):
        return f"its {MANIFEST_FILE} ({manifest['format']}) records no graph hashes to recognise its files by; remove it yourself"
    known: dict[str, Any] = {}
    for role, name in graphs.items():
        if isinstance(name, str):
            known[name] = hashes.get(role)
    if isinstance(tok, dict) and isinstance(tok.get("files"), dict):
        known.update({k: v for k, v in tok["files"].items() if isinstance(k, str)})
    weights = manifest.get("weights")
    if isinstance(weights, dict) and isinstance(weights.get("file"), str):
        known[weights["file"]] = hashes.get("weights")
    golden = manifest.get("golden")
    if isinstance(golden, dict) and isinstance(golden.get("file"), str):
        known[golden["file"]] = golden.get("sha256")
    for name in entries:
        if name == MANIFEST_FILE:
            continue
        p = folder / name
        if name not in known:
            return f"{name} is not a file its {MANIFEST_FILE} names"
        if p.is_symlink() or not p.is_file():
            return f"{name} is not a regular file"
        try:
            if file_sha256(p) != known[name]:
                return f"{name} is not the file its {MANIFEST_FILE} records (sha256 differs: changed since the export)"
        except OSError as exc:
            return f"{name} cannot be read: {exc.strerror or exc}"
    return entries


def describe_entries(folder: Path, limit: int = 3) -> str:
    try:
        entries = sorted(os.listdir(folder))
    except OSError:
        return "entries that cannot be listed"
    shown = ", ".join(entries[:limit]) + (f", ... ({len(entries)} entries)" if len(entries) > limit else "")
    return shown


def check_output_dir(
    path: str | os.PathLike, *, force: bool = False, protect: Iterable[str | os.PathLike] = (), what: str = "output folder",
    flag: str = "--force", ours: Callable[[Path], list[str] | None] = export_files, kind: str = "an edgelin export",
    protected: str = "the checkpoint",
) -> str | None:
    """Check, before any work, that a folder may be written (or replaced) at ``path``.

    Refused: an empty path or ``.``, the current folder or one that holds it, a path that is, holds or
    lies inside one of ``protect`` (e.g. the checkpoint), an existing file or symbolic link, an existing
    folder without ``force``, and -- even with ``force`` -- an existing folder that is neither empty nor
    an edgelin export. Returns what will be replaced ("an empty folder", "an edgelin export (3 files)")
    or None when nothing exists at ``path``. Raises OutputError naming the folder and what it holds.
    """
    if isinstance(path, (str, os.PathLike)) and str(path) in ("", "."):
        raise OutputError(f"the {what} {str(path)!r} would be the current folder; name a new folder, e.g. -o out/")
    path = check_path(path, what, OutputError)
    check_name_lengths(path, what)
    resolved = Path(os.path.realpath(path))
    if _inside(Path(os.path.realpath(Path.cwd())), resolved):
        raise OutputError(f"the {what} {path} is the current folder or holds it; name a new folder")
    for p in protect:
        guarded = Path(os.path.realpath(p))
        if _inside(resolved, guarded) or _inside(guarded, resolved):
            raise OutputError(
                f"the {what} {path} is, holds or lies inside {protected} {p}; write it somewhere else"
            )
    _writable_folder(nearest_existing(path.parent if str(path.parent) else Path(".")), path, what)
    if path.is_symlink():
        raise OutputError(f"the {what} {path} is a symbolic link; name the folder itself or a new one")
    if not path.exists():
        return None
    if not path.is_dir():
        raise OutputError(f"the {what} {path} exists and is not a folder; choose another path")
    if not force:
        raise OutputError(f"{path} already exists; pass {flag} to replace it (only an empty folder or {kind} is replaced)")
    try:
        empty = not os.listdir(path)
    except OSError as exc:
        raise OutputError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    if empty:
        return "an empty folder"
    files = ours(path)  # the files, or why not (a str naming the first entry that blocks), or None
    if files is None or isinstance(files, str):
        why = files if isinstance(files, str) else f"it holds {describe_entries(path)}"
        raise OutputError(
            f"{path} is not {kind} ({why}); {flag} replaces only an empty folder or {kind} -- choose another folder"
        )
    return f"{kind} ({len(files)} files)"


# ---- creating, replacing, cleaning up ------------------------------------------------------------
def make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing ancestors; return the ones created (outermost first) so that a
    failure can remove them again (``remove_created``)."""
    folder = Path(os.path.abspath(folder))
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    missing.reverse()
    try:
        for p in missing:
            p.mkdir()
    except OSError as exc:
        remove_created(missing)
        raise OutputError(f"cannot create the folder {p}: {exc.strerror or exc}") from None
    return missing


def remove_created(folders: list[Path]) -> bool:
    """Remove folders ``make_parents`` created, innermost first, if they are (still) empty; True if all are gone."""
    for p in reversed(folders):
        try:
            p.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            return False
    return True


def _marker_text(folder_name: str) -> str:
    return f"edgelin work folder {folder_name}\n"


def temp_dir(folder: Path, name: str, kind: str = "tmp") -> Path:
    """A new hidden folder ``.NAME.KIND.PID.xxxxxxxx`` in ``folder`` with ordinary permissions, holding the work
    marker (``WORK_MARKER``: its own name) by which a later run tells it from a user's folder of the same name."""
    path, _ = _fresh(Path(folder), f".{name}.{kind}.{os.getpid()}.", "", lambda p: os.mkdir(p, 0o777))
    try:
        (path / WORK_MARKER).write_text(_marker_text(path.name), encoding="utf-8")
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def work_files(folder: Path) -> list[Path]:
    """Every file below ``folder`` but the work marker, in name order: what a finished folder will hold."""
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != WORK_MARKER]


def _has_marker(folder: Path) -> bool:
    marker = folder / WORK_MARKER
    try:
        return not marker.is_symlink() and marker.is_file() and marker.stat().st_size < 256 and \
            marker.read_text(encoding="utf-8") == _marker_text(folder.name)
    except (OSError, UnicodeDecodeError):
        return False


def work_dir(out: Path) -> tuple[Path, list[Path]]:
    """(a new hidden temporary folder beside ``out`` to build it in, the parent folders created for it — for
    ``remove_created`` on failure). OutputError, with nothing left behind, if it cannot be made."""
    parent = out.parent if str(out.parent) else Path(".")
    created = make_parents(parent)
    try:
        return temp_dir(parent, out.name), created
    except OSError as exc:
        remove_created(created)
        raise OutputError(f"cannot write to {parent}: {exc.strerror or exc}; choose a writable output folder") from None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _only_export_files(folder: Path, name: str) -> bool:
    """The folder holds only export files, or (a ``.old`` folder) one subfolder ``name`` that does."""
    for entry in os.scandir(folder):
        if entry.name == WORK_MARKER:
            continue
        if entry.is_symlink():
            return False
        if entry.is_dir():
            if entry.name != name or not all(e.is_file(follow_symlinks=False) and e.name.endswith(EXPORT_FILE_SUFFIXES) for e in os.scandir(entry.path)):
                return False
        elif not entry.name.endswith(EXPORT_FILE_SUFFIXES):
            return False
    return True


def remove_stale_temps(folder: Path, name: str, allowed: Callable[[Path, str], bool] | None = None) -> list[Path]:
    """Remove ``.NAME.tmp.PID.*`` / ``.NAME.old.PID.*`` folders in ``folder`` left by a run that was killed: each
    must hold edgelin's work marker for its own name, its process must be gone, and what it holds must pass
    ``allowed(path, name)`` (default: export files only). Returns the folders removed."""
    allowed = allowed or _only_export_files
    pattern = re.compile(rf"^\.{re.escape(name)}\.(tmp|old)\.(\d+)\.[A-Za-z0-9_]+$")
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = pattern.match(entry.name)
        if not m or entry.is_symlink() or not entry.is_dir() or _pid_alive(int(m.group(2))):
            continue
        path = Path(entry.path)
        try:
            if _has_marker(path) and allowed(path, name):
                shutil.rmtree(path)
                removed.append(path)
        except OSError:
            continue
    return removed


def replace_dir(
    tmp: Path, out: Path, *, force: bool, protect: Iterable[str | os.PathLike] = (),
    ours: Callable[[Path], list[str] | str | None] = export_files, kind: str = "an edgelin export", protected: str = "the checkpoint",
) -> str | None:
    """Move the finished folder ``tmp`` to ``out``. An existing ``out`` is checked again (it may have
    changed while the work ran) and replaced only if ``check_output_dir`` allows it; if the final
    rename fails, the old folder is put back. Returns what was replaced, as ``check_output_dir``."""
    replaced = check_output_dir(out, force=force, protect=protect, ours=ours, kind=kind, protected=protected)
    try:
        (tmp / WORK_MARKER).unlink(missing_ok=True)  # the finished folder holds only what the work wrote
        if replaced is None:
            os.replace(tmp, out)
            return None
        trash = temp_dir(out.parent if str(out.parent) else Path("."), out.name, "old")
        try:
            os.replace(out, trash / out.name)
        except OSError:  # the old folder could not be moved aside: it stays where it is, and the trash goes
            shutil.rmtree(trash, ignore_errors=True)
            raise
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(trash / out.name, out)
            shutil.rmtree(trash, ignore_errors=True)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    except OSError as exc:
        raise OutputError(f"cannot move the new export into {out}: {exc.strerror or exc}") from None
    return replaced


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


__all__ = [
    "atomic_write", "check_replace", "export_holding", "json_format", "json_ready", "png_text", "read_regular", "regular_file", "write_json", "check_output_dir", "check_output_file", "check_output_folder", "export_files", "make_parents", "nearest_existing",
    "remove_created", "remove_stale_temps", "replace_dir", "temp_dir", "work_dir",
]
