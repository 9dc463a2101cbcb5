"""Checkpoints: config.json + model.safetensors round trip; every refusal is a one-line CheckpointError."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
import torch

from edgelin.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, load_config, save_checkpoint, weights_sha256
from edgelin.config import ModelConfig
from edgelin.errors import CheckpointError
from edgelin.model import LinearLM



def tiny_config(**changes) -> ModelConfig:
    base = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=8)
    return base.replace(**changes)


def tiny_model(seed: int = 0, **changes) -> LinearLM:
    torch.manual_seed(seed)
    return LinearLM(tiny_config(**changes)).eval()


@pytest.fixture
def saved(tmp_path) -> tuple[LinearLM, Path]:
    model = tiny_model()
    return model, save_checkpoint(model, tmp_path / "ckpt")


def refusal(path) -> str:
    """Load ``path``; it must fail with a one-line CheckpointError, whose message is returned."""
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    return message


@pytest.mark.parametrize("changes", [
    {},
    {"feature_map": "performer", "n_features": 24, "tie_embeddings": False},
    {"feature_map": "cosformer", "normalisation": "none", "cosformer_horizon": 64},
], ids=["elu+1", "performer-untied", "cosformer-nonorm"])
def test_round_trip_gives_identical_logits(tmp_path, changes):
    model = tiny_model(**changes)
    with torch.no_grad():  # make sure non-default values of every parameter and buffer travel
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_checkpoint(model, tmp_path / "ckpt")
    assert sorted(p.name for p in path.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE], "no temporary files left"
    loaded = load_checkpoint(path)
    assert loaded.cfg == model.cfg
    assert load_config(path) == model.cfg
    assert not loaded.training
    assert all(p.dtype == torch.float32 for p in loaded.state_dict().values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_state = model(ids)
        got, got_state = loaded(ids)
    assert torch.equal(got, want)
    for key in want_state:
        assert torch.equal(got_state[key], want_state[key]), key


def test_save_overwrites_an_existing_checkpoint(saved):
    _, path = saved
    other = tiny_model(seed=1)
    save_checkpoint(other, path)
    loaded = load_checkpoint(path)
    assert torch.equal(loaded.embed.weight, other.embed.weight)


def test_missing_folder(tmp_path):
    assert "does not exist" in refusal(tmp_path / "nowhere")


def test_a_file_is_not_a_folder(saved):
    _, path = saved
    assert "not a folder" in refusal(path / WEIGHTS_FILE)


def test_folder_without_weights(saved):
    _, path = saved
    (path / WEIGHTS_FILE).unlink()
    message = refusal(path)
    assert WEIGHTS_FILE in message


def test_folder_without_config(saved):
    _, path = saved
    (path / CONFIG_FILE).unlink()
    assert CONFIG_FILE in refusal(path)


@pytest.mark.parametrize("with_config", [False, True], ids=["bin-only", "bin-and-config"])
def test_pickle_only_folder_is_refused(tmp_path, with_config):
    folder = tmp_path / "hf"
    folder.mkdir()
    if with_config:
        (folder / CONFIG_FILE).write_text(tiny_config().to_json(), encoding="utf-8")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    message = refusal(folder)
    assert "pytorch_model.bin" in message and "pickle" in message and WEIGHTS_FILE in message


@pytest.mark.parametrize("name", ["model.pt", "model.pth", "weights.bin", "model.ckpt"])
def test_pickle_paths_are_refused(tmp_path, name):
    target = tmp_path / name
    torch.save({"x": torch.zeros(1)}, target)
    message = refusal(target)
    assert "pickle" in message
    assert "pickle" in refusal(tmp_path / ("missing_" + name)), "refused by its name, before touching the disk"


@pytest.mark.parametrize("payload", [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x00\x01", id="two-bytes"),
    pytest.param(random.Random(0).randbytes(4096), id="random"),
    pytest.param((2**40).to_bytes(8, "little") + b"{}", id="huge-header-length"),
    pytest.param((8).to_bytes(8, "little") + b"not json", id="bad-header-json"),
])
def test_corrupt_weights(saved, payload):
    _, path = saved
    (path / WEIGHTS_FILE).write_bytes(payload)
    assert WEIGHTS_FILE in refusal(path)


def test_truncated_weights(saved):
    _, path = saved
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[: len(data) - 100])
    assert WEIGHTS_FILE in refusal(path)


def _edit_config(path: Path, **changes) -> None:
    data = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    data.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(data), encoding="utf-8")


def test_shape_mismatch_names_the_tensor(saved):
    _, path = saved
    _edit_config(path, vocab_size=65)
    message = refusal(path)
    assert "embed.weight" in message and "(64, 32)" in message and "(65, 32)" in message


def test_missing_tensors_are_named(saved):
    _, path = saved
    _edit_config(path, n_layers=3)
    message = refusal(path)
    assert "missing" in message and "blocks.2." in message


def test_unexpected_tensors_are_named(tmp_path):
    path = save_checkpoint(tiny_model(tie_embeddings=False), tmp_path / "ckpt")
    _edit_config(path, tie_embeddings=True)
    message = refusal(path)
    assert "unexpected" in message and "lm_head.weight" in message


@pytest.mark.parametrize("text", ["{", "not json at all", '{"d_model": 32,}', ""])
def test_invalid_config_json(saved, text):
    _, path = saved
    (path / CONFIG_FILE).write_text(text, encoding="utf-8")
    assert "JSON" in refusal(path)


def test_config_json_that_is_not_text(saved):
    _, path = saved
    (path / CONFIG_FILE).write_bytes(b"\xff\xfe\x00\x80\x81garbage")
    assert CONFIG_FILE in refusal(path)


def test_invalid_config_value(saved):
    _, path = saved
    _edit_config(path, feature_map="softmax")
    message = refusal(path)
    assert "feature_map" in message and "elu+1" in message


def test_weights_sha256_is_the_file_digest_and_stable(tmp_path, saved):
    model, path = saved
    digest = weights_sha256(path)
    assert digest == hashlib.sha256((path / WEIGHTS_FILE).read_bytes()).hexdigest()
    assert weights_sha256(path) == digest
    again = save_checkpoint(model, tmp_path / "again")
    assert weights_sha256(again) == digest, "saving the same weights twice gives the same bytes"
    with torch.no_grad():
        model.blocks[1].mlp.down.weight[0, 0] += 1e-3
    changed = save_checkpoint(model, tmp_path / "changed")
    assert weights_sha256(changed) != digest


def test_weights_sha256_refuses_like_load(tmp_path):
    with pytest.raises(CheckpointError):
        weights_sha256(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="pickle"):
        weights_sha256(tmp_path / "model.pt")
