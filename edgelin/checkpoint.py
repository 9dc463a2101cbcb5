"""Checkpoints: a folder with ``config.json`` + ``model.safetensors``. Nothing is ever unpickled. Reading the folder
(``open_checkpoint -> Checkpoint``) is ``edgelin.importers.folder``'s; here, loading a model from it and saving
edgelin's own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from edgelin import streaming
from edgelin.config import ModelConfig
from edgelin.errors import CheckpointError, ConfigError
from edgelin.importers import import_checkpoint
from edgelin.importers.folder import (CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX, Checkpoint, checkpoint_dir, open_checkpoint,
                                      weight_files, weights_sha256)
from edgelin.model import LinearLM
from edgelin.runtime.files import atomic_write, check_replace

SAFETENSORS_METADATA = {"format": "pt"}


def _tensors(model: LinearLM) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.float32).contiguous().cpu() for n, t in model.state_dict().items()}


def model_sha256(model: LinearLM) -> str:
    """sha256 of the bytes ``save_checkpoint`` would write for ``model``'s weights: equal to
    ``weights_sha256`` of its saved checkpoint, so an in-memory model and its file have one identity."""
    from safetensors.torch import save

    return hashlib.sha256(save(_tensors(model), metadata=SAFETENSORS_METADATA)).hexdigest()


def load_config(path: str | Path) -> ModelConfig:
    path = checkpoint_dir(path)
    try:
        return ModelConfig.load(path / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None


def load_checkpoint(path: "str | Path | Checkpoint") -> LinearLM:
    """Load a model (eval mode, float32, CPU) from a checkpoint folder (or a ``Checkpoint`` already read): a
    LinearLM, or, when config.json has a ``model_type``, the model its importer builds (edgelin.importers)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from edgelin.safety import expected_shapes, header_shapes, shape_problems

    ckpt = open_checkpoint(path)
    if ckpt.model_type is not None:
        return import_checkpoint(ckpt)
    path = ckpt.path
    try:
        cfg = ModelConfig.from_dict(ckpt.config)
    except ConfigError as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from None
    # the config is checked against the weights file's header before any memory is spent on either
    headers = header_shapes if streaming.active() is None else streaming.header_shapes  # the latter maps nothing
    problems = shape_problems(expected_shapes(lambda: LinearLM(cfg), cfg), headers(path / WEIGHTS_FILE))
    if problems:
        raise CheckpointError(f"{path}: weights do not match {CONFIG_FILE}: {'; '.join(problems)}")
    if streaming.active() is not None:  # mapped from a scratch file, one tensor read at a time (edgelin.streaming)
        from edgelin.importers.weights import Renamer, load_checkpoint_weights

        return load_checkpoint_weights(ckpt, lambda: LinearLM(cfg), Renamer([]))
    try:
        tensors = load_file(path / WEIGHTS_FILE, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path / WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None
    model = LinearLM(cfg)
    model.load_state_dict({n: t.to(torch.float32) for n, t in tensors.items()})
    return model.eval()


def is_checkpoint_file(path: str | Path) -> bool:
    """True if ``path`` is the config.json or model.safetensors of a checkpoint edgelin wrote: the folder's
    config.json reads as an edgelin ModelConfig, and the weights file's header carries edgelin's metadata."""
    path = Path(path)
    try:
        load_config(path.parent)
    except Exception:  # noqa: BLE001 -- anything that does not read as edgelin's config is not ours
        return False
    if path.name == CONFIG_FILE:
        return True
    if path.name != WEIGHTS_FILE:
        return False
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 << 20:
                return False
            header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and header.get("__metadata__") == SAFETENSORS_METADATA


is_checkpoint_file.kind = "a file of a checkpoint edgelin saved"  # type: ignore[attr-defined]


def save_checkpoint(model: LinearLM, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write config.json + model.safetensors into ``path`` (created if needed); each file is replaced atomically.
    Existing files are replaced only if they are a checkpoint edgelin saved (``is_checkpoint_file``) or with
    ``overwrite=True``; both are checked before either is written."""
    from safetensors.torch import save

    path = Path(path)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        check_replace(path / name, "checkpoint file", overwrite=overwrite, ours=is_checkpoint_file)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(model)
    # both were checked above: the new weights beside the old config must not make the config "not ours"
    atomic_write(path / WEIGHTS_FILE, lambda f: f.write(save(tensors, metadata=SAFETENSORS_METADATA)), overwrite=True)
    atomic_write(path / CONFIG_FILE, lambda f: f.write(model.cfg.to_json().encode("utf-8")), overwrite=True)
    return path


__all__ = ["CONFIG_FILE", "Checkpoint", "open_checkpoint", "WEIGHTS_FILE", "WEIGHTS_INDEX", "load_checkpoint", "load_config", "model_sha256", "save_checkpoint", "weight_files", "weights_sha256"]
