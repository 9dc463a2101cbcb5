"""`edgelin export` from the command line: success, summary, and one-line errors with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from edgelin.checkpoint import save_checkpoint
from edgelin.cli import main
from edgelin.config import ModelConfig
from edgelin.model import LinearLM


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = LinearLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, head_dim=16, chunk_size=16, feature_map="relu"))
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A trace cache of this module's own: its exports (plain, ragged, every position's logits) trace the decode graph
    once; each prefill graph differs, so each is traced (the plain one by the test that reads its progress line)."""
    return tmp_path_factory.mktemp("traces")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_export_writes_the_contract_and_a_summary(checkpoint, traces, tmp_path):
    out = tmp_path / "out"
    result = run("export", checkpoint, "-o", out, "--trace-cache", traces)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "edgelin.json", "golden.json", "prefill.onnx", "weights.data"]
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["model"]["feature_map"] == "relu"
    # 1 layer: S [2 heads, 16, 16] + z [2, 16] in float32 = (512 + 32) * 4 = 2,176 bytes per sequence
    assert "nodes" in result.stdout and "state per sequence: 2,176 bytes" in result.stdout and "-> ok" in result.stdout
    assert "exporting the prefill graph" in result.stderr  # progress goes to stderr
    assert manifest["logits_at"] == "logits_at" and "prefill logits: at the positions input 'logits_at'" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["{missing}", "-o", "{out}"], "does not exist", id="missing-checkpoint"),
        pytest.param(["{ckpt}", "-o", "{out}", "--opset", "7"], "opset 7 is not supported", id="bad-opset"),
        pytest.param(["{ckpt}", "-o", "{out}", "--chunk-size", "-3"], "chunk size -3 is out of range", id="bad-chunk"),
        pytest.param(["{ckpt}", "-o", "{existing}"], "already exists; pass --force", id="exists"),
        pytest.param(["{pickle}", "-o", "{out}"], "pickle checkpoints are refused", id="pickle"),
        pytest.param(["{corrupt}", "-o", "{out}"], "is not a readable safetensors file", id="corrupt"),
        pytest.param(["{badconfig}", "-o", "{out}"], "config field 'feature_map'", id="unsupported-config"),
    ],
)
def test_export_errors_are_one_line(checkpoint, tmp_path, args, message):
    existing = tmp_path / "existing"
    existing.mkdir()
    pickle = tmp_path / "pickled"
    pickle.mkdir()
    (pickle / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((checkpoint / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    badconfig = tmp_path / "badconfig"
    badconfig.mkdir()
    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["feature_map"] = "sigmoid"
    (badconfig / "config.json").write_text(json.dumps(cfg))
    (badconfig / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    names = dict(missing=tmp_path / "nope", out=tmp_path / "out", ckpt=checkpoint, existing=existing, pickle=pickle, corrupt=corrupt, badconfig=badconfig)
    result = run("export", *[a.format(**names) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("edgelin: error: ") and message in lines[-1], result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_export_help_teaches():
    result = run("export", "--help")
    assert result.exit_code == 0
    for text in ("CHECKPOINT", "--chunk-size", "--force", "--no-check", "Examples"):
        assert text in result.output


def test_export_ragged_gives_the_prefill_graph_lengths(checkpoint, traces, tmp_path):
    out = tmp_path / "out"
    result = run("export", checkpoint, "-o", out, "--ragged", "--trace-cache", traces)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["lengths"] == "lengths"
    assert {"name": "lengths", "dtype": "int64", "shape": ["batch"]} in manifest["io"]["prefill"]["inputs"]
    assert "ragged prefill: input 'lengths'" in result.stdout and "-> ok" in result.stdout


def test_export_all_logits_leaves_the_prefill_graph_without_logits_at(checkpoint, traces, tmp_path):
    """For a client older than the logits_at input: every position's logits, the manifest as before the field."""
    out = tmp_path / "out"
    result = run("export", checkpoint, "-o", out, "--all-logits", "--trace-cache", traces)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "edgelin.json").read_text())
    assert "logits_at" not in manifest and manifest["logits_layout"]["positions"] == "every"
    assert [t["name"] for t in manifest["io"]["prefill"]["inputs"]][:2] == ["input_ids", "state.0.S"]
    assert manifest["io"]["prefill"]["outputs"][0]["shape"] == ["batch", "sequence", 256]
    assert "prefill logits: every position" in result.stdout and "-> ok" in result.stdout
