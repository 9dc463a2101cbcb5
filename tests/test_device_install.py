"""The device install: a fresh venv holding only the edgelin wheel (installed with --no-deps), numpy, click,
``tokenizers`` and the plain CPU ``onnxruntime`` package -- no torch, no onnx, no onnxruntime-gpu -- runs
``edgelin generate`` on an export (byte tokenizer, and a Hugging Face tokenizer.json) and gives the same text
as this environment's runtime. Builds a wheel and a venv (about a
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


def _hf_export(model, tmp_path: Path) -> Path:
    """An export of ``model`` (256 ids) with a BPE tokenizer.json of 256 ids trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from edgelin.exporters import export

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["The for statement is used to iterate over the elements of a sequence.", "def add(a, b):\n    return a + b\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=256, special_tokens=["[UNK]"], initial_alphabet=[chr(c) for c in range(32, 127)]))
    assert tok.get_vocab_size(with_added_tokens=True) <= 256
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    out = tmp_path / "hf-export"
    export(model, out, check=False, tokenizer=folder)
    return out


def test_generate_in_a_venv_without_torch(exported, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", tmp_path / "dist", src])
    [wheel] = (tmp_path / "dist").glob("edgelin-*.whl")
    env_dir = tmp_path / "device"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([py, "-m", "pip", "install", "-q", "--no-deps", wheel])
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy", "click", "onnxruntime", "tokenizers"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        pytest.skip(f"cannot install numpy, click, onnxruntime, tokenizers from the package index here: {r.stderr.strip().splitlines()[-1:]}")
    listed = _run([py, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "torch" not in listed and "onnxruntime-gpu" not in listed and "\nonnx==" not in listed
    assert "onnxruntime==" in listed and "tokenizers==" in listed

    _, export_dir = exported("elu+1")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    got = _run([env_dir / "bin" / "edgelin", "generate", export_dir, "-p", "The for statement", "-n", "24", "--provider", "cpu", "--json"], env=env, cwd=tmp_path)
    import json

    from edgelin.runtime import generate_text

    want = generate_text(export_dir, "The for statement", max_new_tokens=24, provider="cpu")
    assert json.loads(got.stdout)["text"] == want["text"]

    # a Hugging Face tokenizer.json travels with the export and runs on the device with the tokenizers package
    hf_dir = _hf_export(exported("elu+1")[0], tmp_path)
    got = _run([env_dir / "bin" / "edgelin", "generate", hf_dir, "-p", "The for statement", "-n", "24", "--provider", "cpu", "--json"], env=env, cwd=tmp_path)
    want = generate_text(hf_dir, "The for statement", max_new_tokens=24, provider="cpu")
    got = json.loads(got.stdout)
    assert got["has_text"] and got["text"] == want["text"] and got["ids"] == want["ids"] and len(want["ids"]) == 24
    assert want["text"].strip()
    # nothing on the way imported torch (it is not even installed): say so explicitly for the library too
    probe = "import sys, edgelin.runtime, edgelin.cli; assert 'torch' not in sys.modules; print('ok')"
    assert _run([py, "-c", probe], env=env, cwd=tmp_path).stdout.strip() == "ok"
