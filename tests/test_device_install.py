"""The device install: a fresh venv holding only the edgelin wheel (installed with --no-deps), numpy, click and
the plain CPU ``onnxruntime`` package -- no torch, no onnx, no onnxruntime-gpu -- runs ``edgelin generate``
on an export and gives the same text as this environment's runtime. Builds a wheel and a venv (about a
minute; needs the package index), so it is marked ``slow``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", "*.onnx")

pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def test_generate_in_a_venv_without_torch(exported, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", src])
    [wheel] = (tmp_path / "dist").glob("edgelin-*.whl")
    env_dir = tmp_path / "device"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", wheel])
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy", "click", "onnxruntime"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"cannot install numpy, click, onnxruntime from the package index here: {r.stderr.strip().splitlines()[-1:]}")
    listed = _run([py, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "torch" not in listed and "onnxruntime-gpu" not in listed and "\nonnx==" not in listed
    assert "onnxruntime==" in listed

    _, export_dir = exported("elu+1")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    got = _run([env_dir / "bin" / "edgelin", "generate", export_dir, "-p", "The for statement", "-n", "24", "--provider", "cpu", "--json"], env=env, cwd=tmp_path)
    import json

    from edgelin.runtime import generate_text

    want = generate_text(export_dir, "The for statement", max_new_tokens=24, provider="cpu")
    assert json.loads(got.stdout)["text"] == want["text"]
    # nothing on the way imported torch (it is not even installed): say so explicitly for the library too
    probe = "import sys, edgelin.runtime, edgelin.cli; assert 'torch' not in sys.modules; print('ok')"
    assert _run([py, "-c", probe], env=env, cwd=tmp_path).stdout.strip() == "ok"
