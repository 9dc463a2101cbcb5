"""A full disk, a file-size limit and repeated Ctrl-C: said in one line, nothing left behind, no traceback."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgelin.errors import ExportError, OutputError

ROOT = Path(__file__).resolve().parents[2]


def _litter(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


# ---- export ---------------------------------------------------------------------------------------------------
def test_an_export_past_the_file_size_limit_says_file_too_large(tmp_path):
    """RLIMIT_FSIZE in a child process: onnx writes the weights with numpy's tofile, whose error ("problem writing
    element 1024 to file") drops the reason; the export says it."""
    script = textwrap.dedent("""
        import resource, sys
        import torch
        from edgelin.config import ModelConfig
        from edgelin.model import LinearLM
        from edgelin.errors import EdgelinError
        from edgelin.exporters import export
        torch.manual_seed(0)
        model = LinearLM(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16)).eval()
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, resource.RLIM_INFINITY))
        try:
            export(model, sys.argv[1], check=False)
        except EdgelinError as exc:
            print("ERROR", exc)
    """)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = r.stdout.strip()
    assert line.startswith("ERROR export failed: file too large (this process may write files of at most 60,000 bytes: `ulimit -f`)"), (line, r.stderr[-2000:])
    assert "problem writing element" not in line and "nothing was written" in line
    assert _litter(tmp_path, set()) == []


@pytest.mark.parametrize("reason", ["errno", "lost"])
def test_an_export_onto_a_full_disk_says_no_space_left(exported, trace_cache, tmp_path, monkeypatch, reason):
    """A write that fails with ENOSPC, and one whose writer lost the reason on a file system with no space left."""
    from edgelin.exporters import exporter

    model, _ = exported("elu+1")

    def full(*_a, **_k):
        if reason == "errno":
            raise OSError(errno.ENOSPC, "No space left on device")
        # the disk filled up while the export wrote (it had room before the trace): no block free now
        monkeypatch.setattr(os, "statvfs", lambda _p: os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0, 255)))
        raise OSError("problem writing element 1024 to file")

    monkeypatch.setattr(exporter, "store_once", full)
    with pytest.raises(ExportError) as err:
        exporter.export(model, tmp_path / "out", check=False, trace_cache=trace_cache)
    msg = str(err.value)
    assert msg.startswith("export failed: no space left on device (" + ("0 bytes free in " if reason == "lost" else "")), msg
    assert "problem writing element" not in msg and msg.endswith("nothing was written") and "\n" not in msg
    assert _litter(tmp_path, set()) == []


def test_an_export_whose_trace_cannot_fit_the_disk_is_refused_before_it(exported, tmp_path, monkeypatch):
    """The export's weights file holds at least the model's weights at its precision's bytes a value: where the disk
    cannot hold that much, the export says so before tracing, in one line, and leaves nothing."""
    import shutil

    from edgelin.exporters import exporter, source

    model, _ = exported("elu+1")
    values = sum(p.numel() for p in model.parameters())
    traced = []

    def trace(*a, **k):  # the trace, faked: reached or not
        traced.append(a)
        raise RuntimeError("traced")

    monkeypatch.setattr(exporter, "trace_graphs", trace)
    monkeypatch.setattr(source.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**9, 10**9 - 4000, 4000))
    with pytest.raises(ExportError) as err:
        exporter.export(model, tmp_path / "out", check=False, precision="int4")
    msg = str(err.value)
    assert msg == (f"the export's weights need at least {values / 2e6:,.1f} MB of free disk in {tmp_path} (the model's {values:,} "
                   "weights in int4) and 0.0 MB are free there; make room, or export to a disk with more space"), msg
    assert traced == [] and _litter(tmp_path, set()) == []
    monkeypatch.setattr(source.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**9, 10**9 - 4 * values, 4 * values))
    with pytest.raises(ExportError, match=r"RuntimeError: traced"):  # just enough room for fp32: on to the trace
        exporter.export(model, tmp_path / "out", check=False)
    with pytest.raises(ExportError, match=r"at least .* \(the model's .* weights in fp32\)"):  # a byte short of it
        monkeypatch.setattr(source.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(10**9, 10**9, 4 * values - 1))
        exporter.export(model, tmp_path / "out", check=False)
    assert len(traced) == 1


# ---- edgelin web ----------------------------------------------------------------------------------------------
def test_web_onto_a_full_disk_says_it_in_one_line(exported, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from edgelin import web
    from edgelin.cli import main

    ort = tmp_path / "ort"
    ort.mkdir()
    for f in web.ORT_FILES:
        (ort / f).write_text("x")
    real = web.shutil.copyfile
    calls = []

    def copy(src, dst, *a, **k):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst, *a, **k)

    monkeypatch.setattr(web.shutil, "copyfile", copy)
    with pytest.raises(OutputError, match=r"cannot write the site .*site: no space left on device .*; nothing was written$"):
        web.write_site(exported("elu+1")[1], tmp_path / "site", ort_web=ort)
    assert _litter(tmp_path, {"ort"}) == []
    calls.clear()
    r = CliRunner().invoke(main, ["web", str(exported("elu+1")[1]), "-o", str(tmp_path / "site"), "--ort-web", str(ort)])
    assert r.exit_code == 2 and "Traceback" not in r.output and "no space left on device" in r.output, r.output
    assert _litter(tmp_path, {"ort"}) == []


# ---- repeated Ctrl-C ------------------------------------------------------------------------------------------
def test_ctrl_c_while_the_interpreter_exits_prints_no_trace(tmp_path):
    """The command is interrupted; another Ctrl-C arrives while an exit handler registered earlier (torch's, onnx's)
    runs: no "Exception ignored in atexit callback", no traceback."""
    script = textwrap.dedent("""
        import atexit, os, signal, sys, time
        def slow_handler():  # as a library's exit handler, registered at import: a Ctrl-C arrives while it runs
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        atexit.register(slow_handler)
        from edgelin import web
        def interrupted(*a, **k):
            raise KeyboardInterrupt
        web.write_site = interrupted
        from edgelin.cli import main
        main(["web", sys.argv[1], "-o", sys.argv[2]])
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "export"), str(tmp_path / "site")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 128 + signal.SIGINT, (r.returncode, r.stderr)
    assert "interrupted (SIGINT)" in r.stderr and "Exception ignored" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_second_ctrl_c_during_the_cleanup_still_removes_the_work_folder(exported, trace_cache, tmp_path, monkeypatch):
    from edgelin.exporters import exporter

    model, _ = exported("elu+1")

    def first(*_a, **_k):
        raise KeyboardInterrupt

    real = exporter.shutil.rmtree

    def rmtree(path, *a, **k):  # the second Ctrl-C arrives as the work folder is being removed
        os.kill(os.getpid(), signal.SIGINT)
        return real(path, *a, **k)

    monkeypatch.setattr(exporter, "store_once", first)
    monkeypatch.setattr(exporter.shutil, "rmtree", rmtree)
    with pytest.raises(KeyboardInterrupt):
        exporter.export(model, tmp_path / "out", check=False, trace_cache=trace_cache)
    assert _litter(tmp_path, set()) == []
