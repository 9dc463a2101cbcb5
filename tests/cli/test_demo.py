"""`edgelin demo`, the README's first command, end to end on the bundled model."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgelin.cli import main
from edgelin.models import bundled_checkpoint

pytestmark = pytest.mark.skipif(bundled_checkpoint() is None, reason="this checkout has no bundled model")


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo-export"
    result = CliRunner().invoke(main, ["demo", "-n", "24", "--provider", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    # the default prompts, a code one then a prose one, each followed by its continuation
    assert text.startswith("def fibonacci(n):") and "\n\nThe for statement" in text
    assert "temperature 0.7, top-p 0.9, seed 0" in result.stderr
    assert "parity (ONNX Runtime vs PyTorch): PASS" in text
    assert "tokens/s" in text and "at 100,000 tokens" in text
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["source"] and (out / "prefill.onnx").is_file() and (out / "decode.onnx").is_file()
    for step in ("[1/3] exporting", "[2/3] validating", "[3/3] generating"):
        assert step in result.stderr


def test_export_defaults_to_the_bundled_model(tmp_path):
    result = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "out"), "--no-check"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "edgelin.json").read_text())
    from edgelin.checkpoint import weights_sha256

    assert manifest["source"] == weights_sha256(bundled_checkpoint())


def test_demo_rejects_an_empty_prompt():
    result = CliRunner().invoke(main, ["demo", "--prompt", ""])
    assert result.exit_code == 2 and "prompt is empty" in result.stderr
