"""The device install: a fresh venv holding only the edgelin wheel (installed with --no-deps), numpy, click,
``tokenizers`` and the plain CPU ``onnxruntime`` package -- no torch, no onnx, no onnxruntime-gpu -- runs
``edgelin generate`` on an export (byte tokenizer, and a Hugging Face tokenizer.json) and gives the same text
as this environment's runtime. Builds a wheel and a venv (about a
minute; needs the package index), so it is marked ``slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.venvs import device_venv
from testkit.venvs import run as _run

pytestmark = pytest.mark.slow


def _hf_export(model, tmp_path: Path, trace_cache: Path) -> Path:
    """An export of ``model`` (256 ids) with a BPE tokenizer.json of 256 ids trained here; its graphs from ``trace_cache``
    where the run's shared export of ``model`` traced them (the tokenizer is added after the trace)."""
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
    export(model, out, check=False, tokenizer=folder, trace_cache=trace_cache)
    return out


def test_generate_in_a_venv_without_torch(exported, trace_cache, tmp_path):
    bindir, env = device_venv(tmp_path, "onnxruntime")
    py = bindir / "python"
    listed = _run([py, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert "onnxruntime-gpu" not in listed

    _, export_dir = exported("elu+1")
    got = _run([bindir / "edgelin", "generate", export_dir, "-p", "The for statement", "-n", "24", "--provider", "cpu", "--json"], env=env, cwd=tmp_path)
    import json

    from edgelin.runtime import generate_text

    want = generate_text(export_dir, "The for statement", max_new_tokens=24, provider="cpu")
    assert json.loads(got.stdout)["text"] == want["text"]

    # a Hugging Face tokenizer.json travels with the export and runs on the device with the tokenizers package
    hf_dir = _hf_export(exported("elu+1")[0], tmp_path, trace_cache)
    got = _run([bindir / "edgelin", "generate", hf_dir, "-p", "The for statement", "-n", "24", "--provider", "cpu", "--json"], env=env, cwd=tmp_path)
    want = generate_text(hf_dir, "The for statement", max_new_tokens=24, provider="cpu")
    got = json.loads(got.stdout)
    assert got["has_text"] and got["text"] == want["text"] and got["ids"] == want["ids"] and len(want["ids"]) == 24
    assert want["text"].strip()
    # the golden-output check runs there too, without torch
    checked = _run([bindir / "edgelin", "check", export_dir, "--json", tmp_path / "check.json"], env=env, cwd=tmp_path)
    assert checked.stdout.splitlines()[-1].startswith("PASS: 2 of 2 comparisons within budget")
    # nothing on the way imported torch (it is not even installed): say so explicitly for the library too
    probe = "import sys, edgelin.runtime, edgelin.cli; assert 'torch' not in sys.modules; print('ok')"
    assert _run([py, "-c", probe], env=env, cwd=tmp_path).stdout.strip() == "ok"
