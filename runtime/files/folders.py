"""Output folders: an existing one is replaced only where it is empty or an export edgelin wrote (recognised by
content), a new one is built in a hidden temporary folder beside it (holding edgelin's work marker) and moved into
place, and the temporary folders a killed run left behind are removed by the next run. Standard library only."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from edgelin.errors import OutputError
from edgelin.runtime.files.atomic import create_fresh
from edgelin.runtime.files.paths import check_name_lengths, check_path, check_writable_folder, nearest_existing
from edgelin.runtime.files.reading import read_regular
from edgelin.runtime.files.replace import MANIFEST_FILE, MAX_RECOGNISED_BYTES

EXPORT_FILE_SUFFIXES = (".onnx", ".json", ".data")  # what an export (or its temporary folder) may hold
WORK_MARKER = ".edgelin-work"  # in each temporary folder while edgelin builds in it; removed before it is moved into place


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies inside b (both resolved)."""
    return a == b or b in a.parents


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 (lowercase hex) of a file, read in 1 MiB blocks (``edgelin.runtime.manifest`` has it too)."""
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
    check_writable_folder(nearest_existing(path.parent if str(path.parent) else Path(".")), path, what)
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
    path, _ = create_fresh(Path(folder), f".{name}.{kind}.{os.getpid()}.", "", lambda p: os.mkdir(p, 0o777))
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
