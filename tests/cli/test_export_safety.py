"""An export never deletes what edgelin did not write, and leaves no litter when it is killed."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgelin.errors import OutputError
from edgelin.runtime.files import WORK_MARKER, check_output_dir, remove_stale_temps
from edgelin.runtime.manifest import canonical_manifest_equal


def tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def ckpt(exported, tmp_path_factory):
    from edgelin.checkpoint import save_checkpoint

    return save_checkpoint(exported("elu+1")[0], tmp_path_factory.mktemp("safety") / "ckpt")


# ---- --force never deletes a folder that is not an export -------------------------------------------
def _user_docs(p: Path) -> None:
    p.mkdir()
    (p / "thesis.txt").write_text("years of work")


def _export_plus_a_file(p: Path, export_dir: Path) -> None:
    shutil.copytree(export_dir, p)
    (p / "notes.md").write_text("mine")


def _export_plus_a_folder(p: Path, export_dir: Path) -> None:
    shutil.copytree(export_dir, p)
    (p / "runs").mkdir()


def _foreign_manifest(p: Path) -> None:
    p.mkdir()
    (p / "edgelin.json").write_text('{"format": "someone-else/1"}')
    (p / "prefill.onnx").write_bytes(b"not ours")


def _nested_only(p: Path) -> None:
    (p / "a" / "b").mkdir(parents=True)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p, e: _user_docs(p), id="user-documents"),
        pytest.param(_export_plus_a_file, id="export-plus-a-user-file"),
        pytest.param(_export_plus_a_folder, id="export-plus-a-folder"),
        pytest.param(lambda p, e: _foreign_manifest(p), id="foreign-manifest"),
        pytest.param(lambda p, e: _nested_only(p), id="empty-subfolders"),
    ],
)
def test_force_never_deletes_a_folder_that_is_not_an_export(exported, ckpt, tmp_path, make):
    from edgelin.exporters import export

    target = tmp_path / "target"
    make(target, exported("elu+1")[1])
    before = tree(tmp_path)
    with pytest.raises(OutputError, match="not an edgelin export"):
        export(ckpt, target, force=True, check=False)
    assert tree(tmp_path) == before


def test_force_replaces_an_export_and_says_so(exported, trace_cache, tmp_path):
    from edgelin.exporters import export

    model, src = exported("elu+1")
    target = tmp_path / "target"
    shutil.copytree(src, target)
    (target / "edgelin.json").write_text((target / "edgelin.json").read_text().replace('"edgelin_version"', '"old_note": 1, "edgelin_version"'))
    said = []
    export(model, target, force=True, check=False, progress=said.append, trace_cache=trace_cache)  # the publishing is tested
    assert any("replacing" in s and "an edgelin export (5 files)" in s for s in said), said
    assert "old_note" not in (target / "edgelin.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temporary or trash folder left


def test_check_output_dir_describes_what_it_replaces(exported, tmp_path):
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", force=True) == "an empty folder"
    assert check_output_dir(exported("elu+1")[1], force=True) == "an edgelin export (5 files)"
    assert check_output_dir(tmp_path / "new") is None


# ---- killed exports -----------------------------------------------------------------------------
# What these tests test is the publishing (the temporary folder, the signal handling, the clean-up), not the
# tracing: the CLI runs in a subprocess whose tracer is a fast writer (FAST_TRACER) that writes a stand-in
# first graph at once and then "traces" the second one until the test's signal arrives. So the kill always
# lands while the second graph is being made, and no test waits ~15 s for torch.onnx. The real tracer's
# export, interrupted, is what `edgelin export` does in tests/cli/test_export_cli.py's successful runs.
FAST_TRACER = """
import sys, time
from pathlib import Path
import edgelin.exporters.tracing as exporter

def fast_export_graph(module, example, names, dynamic, opset, path, *, external=False, ops="portable"):
    if Path(path).name == "prefill.onnx":
        Path(path).write_bytes(b"a stand-in for the prefill graph")
    else:
        time.sleep(600)  # the second graph, until the signal

exporter.export_graph = fast_export_graph
from edgelin.cli import main
sys.argv[0] = "edgelin"
main()
"""


def _start_export(ckpt: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A test run started as a background job inherits SIGINT ignored (POSIX shells do that without job
    # control), and Python then never raises KeyboardInterrupt: give the export the default disposition,
    # as an interactive terminal would.
    return subprocess.Popen(
        [sys.executable, "-c", FAST_TRACER, "export", str(ckpt), "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _wait_for_graph_writing(proc: subprocess.Popen, parent: Path, name: str, timeout: float = 180.0) -> Path:
    """Wait until the export's temporary folder holds its first graph (the second is being exported), return it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        temps = [p for p in parent.iterdir() if p.name.startswith(f".{name}.tmp.")] if parent.is_dir() else []
        # a graph, not the work marker: the marker is written as the folder is made, before the export's cleanup
        # is in place (a signal then, on a loaded machine, left the folder for the next export to remove)
        if temps and any(p.name != WORK_MARKER for p in temps[0].iterdir()):
            return temps[0]
        if proc.poll() is not None:
            pytest.fail(f"the export ended before it could be killed: {proc.stderr.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the export never created its temporary folder")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])  # SIGHUP: the terminal closed
def test_sigterm_during_export_leaves_nothing(ckpt, tmp_path, sig):
    out = tmp_path / "deep" / "out"  # the parent folders are created by the export, and must go again
    proc = _start_export(ckpt, out)
    _wait_for_graph_writing(proc, tmp_path / "deep", "out")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"edgelin: interrupted ({signal.Signals(sig).name})")
    assert list(tmp_path.iterdir()) == []


def test_sigint_during_export_leaves_nothing(ckpt, tmp_path):
    proc = _start_export(ckpt, tmp_path / "out")
    _wait_for_graph_writing(proc, tmp_path, "out")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_sigkill_litter_is_removed_by_the_next_export_to_the_same_place(ckpt, exported, trace_cache, tmp_path):
    from edgelin.exporters import export

    proc = _start_export(ckpt, tmp_path / "out")
    tmp = _wait_for_graph_writing(proc, tmp_path, "out")
    proc.kill()
    proc.wait(timeout=60)
    assert tmp.exists()  # SIGKILL cannot be cleaned up after ...
    mine = tmp_path / ".out.tmp.notes"  # a user's folder that looks alike, but is not the pattern
    mine.mkdir()
    other = tmp_path / ".other.tmp.1.abc"  # another export's name: not this export's business
    other.mkdir()
    said = []
    # the graphs from the run's trace cache (the shared export traced them): the litter is removed before any trace
    export(exported("elu+1")[0], tmp_path / "out", check=False, trace_cache=trace_cache, progress=said.append)
    assert not tmp.exists()  # ... but the next export to the same place removes it, and says so
    assert any("left by an earlier export that was killed" in s for s in said)
    assert mine.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp.1.abc", ".out.tmp.notes", "out"]


def test_stale_temps_of_a_live_process_or_with_user_files_are_kept(tmp_path):
    live = tmp_path / f".out.tmp.{os.getpid()}.abc"  # this process is alive: maybe still writing
    live.mkdir()
    (live / "prefill.onnx").write_bytes(b"x")
    dead_pid = 2**22 + 12345  # above the default pid_max of 4,194,304: no such process
    with_user_file = tmp_path / f".out.tmp.{dead_pid}.abc"
    with_user_file.mkdir()
    (with_user_file / "thesis.txt").write_text("mine")
    stale = tmp_path / f".out.tmp.{dead_pid}.def"
    stale.mkdir()
    (stale / WORK_MARKER).write_text(f"edgelin work folder {stale.name}\n")  # what temp_dir writes
    (stale / "prefill.onnx").write_bytes(b"x")
    # a user's folder of the very pattern, holding only files of export suffixes, but no marker: not edgelin's
    lookalike = tmp_path / f".out.tmp.{dead_pid}.abcd"
    lookalike.mkdir()
    (lookalike / "notes.json").write_text('{"my": "notes"}')
    (lookalike / "thesis.data").write_text("x")
    # a marker copied from another folder (its name is not this folder's) proves nothing either
    copied = tmp_path / f".out.tmp.{dead_pid}.ghi"
    copied.mkdir()
    (copied / WORK_MARKER).write_text(f"edgelin work folder {stale.name}\n")
    (copied / "notes.json").write_text("{}")
    assert remove_stale_temps(tmp_path, "out") == [stale]
    assert live.exists() and with_user_file.exists() and not stale.exists()
    assert (lookalike / "notes.json").read_text() == '{"my": "notes"}' and (copied / "notes.json").exists()


def test_work_folders_carry_the_marker_and_finished_folders_do_not(tmp_path):
    from edgelin.runtime.files import replace_dir, temp_dir

    work = temp_dir(tmp_path, "out")
    assert (work / WORK_MARKER).read_text() == f"edgelin work folder {work.name}\n"
    (work / "edgelin.json").write_text("{}")
    replace_dir(work, tmp_path / "out", force=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["edgelin.json"]


def test_a_killed_web_serve_leaves_a_scratch_folder_the_next_one_removes(tmp_path, monkeypatch):
    import tempfile

    from edgelin.runtime.files import temp_dir
    from edgelin.web import SERVE_SCRATCH, serve_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead_pid = 2**22 + 12345
    killed = temp_dir(tmp_path, SERVE_SCRATCH)  # as a --serve run made it, then renamed as if its process were gone
    killed = killed.rename(tmp_path / f".{SERVE_SCRATCH}.tmp.{dead_pid}.aaaa")
    (killed / WORK_MARKER).write_text(f"edgelin work folder {killed.name}\n")
    (killed / "site" / "export").mkdir(parents=True)
    (killed / "site" / "index.html").write_text("<html>")
    (killed / "site" / "export" / "decode.onnx").write_bytes(b"x")
    users = tmp_path / f".{SERVE_SCRATCH}.tmp.{dead_pid}.bbbb"  # the pattern, the marker, and a user's file beside the site
    users.mkdir()
    (users / WORK_MARKER).write_text(f"edgelin work folder {users.name}\n")
    (users / "notes.txt").write_text("mine")
    fresh = serve_dir()
    assert not killed.exists() and (users / "notes.txt").read_text() == "mine"
    assert fresh.parent == tmp_path and fresh.name.startswith(f".{SERVE_SCRATCH}.tmp.{os.getpid()}.")


# ---- manifests compare by content ------------------------------------------------------------------
def test_reindented_manifests_are_equal_and_changed_ones_are_not(exported):
    import json

    text = (exported("elu+1")[1] / "edgelin.json").read_text()
    d = json.loads(text)
    assert canonical_manifest_equal(text, json.dumps(d, indent=7, sort_keys=False))
    assert canonical_manifest_equal(text, json.dumps(d, separators=(",", ":")))
    d["source"] = "0" * 64
    assert not canonical_manifest_equal(text, json.dumps(d))
    assert not canonical_manifest_equal(text, "{not json")
