"""Fresh virtual environments that hold what a device holds: the edgelin wheel (installed with --no-deps), numpy,
click, ``tokenizers`` and one onnxruntime package -- no torch, no onnx. Used by the device-install and the
OpenVINO tests (each builds a wheel and a venv: about a minute, and needs the package index)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IGNORED = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", "*.onnx")


def run(cmd, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; its output in the assertion message if it fails."""
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def device_venv(tmp_path: Path, onnxruntime_package: str) -> tuple[Path, dict[str, str]]:
    """(the venv's bin folder, an environment to run it in) with the wheel of this checkout and
    ``onnxruntime_package``; skips where the package index cannot be reached."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", src])
    [wheel] = (tmp_path / "dist").glob("edgelin-*.whl")
    env_dir = tmp_path / "device"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "--no-deps", wheel])
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy", "click", onnxruntime_package, "tokenizers"],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"cannot install numpy, click, {onnxruntime_package}, tokenizers from the package index here: {r.stderr.strip().splitlines()[-1:]}")
    listed = run([py, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "torch" not in listed and "\nonnx==" not in listed
    assert f"{onnxruntime_package}==" in listed and "tokenizers==" in listed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return env_dir / "bin", env
