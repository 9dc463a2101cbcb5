"""One export per configuration per test run, shared by every test and every xdist worker.

An export (two torch.onnx traces) costs ~10 s warm and ~20 s cold; most tests only read an export. The cache
keys an export by everything that makes it differ (the model's recipe and the export's options, as a JSON
value), exports it once under a file lock in a folder every worker of the run sees, and hands the folder out.
Tests that change an export copy it first (``copy_of``); the cached folders are made read-only-by-convention
and ``check_untouched`` (run at the end of the session) fails the run if a test wrote into one.

Counting: every torch.onnx trace in a test process is recorded (``count_traces``), so the run ends with the
number of graphs traced, by whom (the cache or a test that exports on its own).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

RUN_DIR_NAME = "edgelin-shared"


def run_root(basetemp: Path) -> Path:
    """The folder shared by every worker of one pytest run: xdist gives each worker basetemp/popen-gwN."""
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    path = root / RUN_DIR_NAME
    path.mkdir(parents=True, exist_ok=True)
    return path


def key_digest(key: Any) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _fingerprint(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


class ExportCache:
    """``get(label, key, build)`` -> the folder ``build(folder)`` exported into, once per key per run."""

    def __init__(self, root: Path):
        self.root = root / "exports"
        self.root.mkdir(parents=True, exist_ok=True)
        self.seen: dict[str, Path] = {}

    def get(self, label: str, key: Any, build: Callable[[Path], Any]) -> Path:
        digest = key_digest([label, key])
        folder = self.root / f"{label}-{digest}"
        done = self.root / f"{label}-{digest}.done"
        with _locked(self.root / f"{digest}.lock"):
            if not done.exists():
                if folder.exists():  # a worker died half-way: start over
                    shutil.rmtree(folder)
                start = time.perf_counter()
                build(folder)
                done.write_text(json.dumps({"label": label, "key": key, "seconds": round(time.perf_counter() - start, 1),
                                            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                            "files": _fingerprint(folder)}, default=str))
        self.seen[digest] = folder
        return folder

    def untouched(self) -> list[str]:
        """Cached exports whose files changed after they were made (a test wrote into a shared folder)."""
        bad = []
        for done in sorted(self.root.glob("*.done")):
            record = json.loads(done.read_text())
            folder = self.root / done.name[: -len(".done")]
            if folder.exists() and {k: list(v) for k, v in _fingerprint(folder).items()} != record["files"]:
                bad.append(f"{record['label']} ({folder})")
        return bad


def copy_of(export_dir: Path, dst: Path) -> Path:
    """A private copy of a cached export that a test may change."""
    shutil.copytree(export_dir, dst)
    return dst


# ---- counting torch.onnx traces ---------------------------------------------------------------------------

def count_traces(root: Path) -> None:
    """Wrap torch.onnx.export in this process so every trace appends a line to root/traces-<worker>.log."""
    import torch.onnx

    original = torch.onnx.export
    if getattr(original, "_edgelin_counted", False):
        return
    log = root / f"traces-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"

    def counted(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            with open(log, "a") as fh:
                fh.write(json.dumps({"test": test, "seconds": round(time.perf_counter() - start, 2)}) + "\n")

    counted._edgelin_counted = True  # type: ignore[attr-defined]
    torch.onnx.export = counted


def trace_summary(root: Path) -> list[str]:
    """Lines for the end of the run: graphs traced, their time, and the tests that traced most."""
    records = []
    for log in root.glob("traces-*.log"):
        records += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if not records:
        return []
    by_test: dict[str, list[float]] = {}
    for r in records:
        by_test.setdefault(r["test"], []).append(r["seconds"])
    exports = sorted(root.glob("exports/*.done"))
    lines = [f"torch.onnx traces in test processes: {len(records)} ({sum(r['seconds'] for r in records):.0f} s), "
             f"{len(exports)} cached exports"]
    top = sorted(by_test.items(), key=lambda kv: -sum(kv[1]))[:8]
    lines += [f"  {len(s):3d} traces {sum(s):6.1f} s  {t}" for t, s in top]
    return lines


__all__ = ["ExportCache", "copy_of", "count_traces", "key_digest", "run_root", "trace_summary"]
