"""Checkpoints: a folder with ``config.json`` + ``model.safetensors``. Nothing is ever unpickled."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from edgelin.config import ModelConfig
from edgelin.errors import CheckpointError, ConfigError, RuntimeInputError
from edgelin.model import LinearLM
from edgelin.runtime.files import atomic_write, check_replace, read_regular

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint (transformers' save_pretrained above its shard size)
SAFETENSORS_METADATA = {"format": "pt"}
INDEX_BYTES = 64 << 20  # the largest model.safetensors.index.json read (a 1 B model's is ~50 kB)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _checkpoint_dir(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: pickle checkpoints are refused (unpickling can run code); save the weights as {WEIGHTS_FILE}")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; pass a folder with {CONFIG_FILE} and {WEIGHTS_FILE}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a folder; pass a folder with {CONFIG_FILE} and {WEIGHTS_FILE}")
    if not (path / WEIGHTS_FILE).is_file() and not (path / WEIGHTS_INDEX).is_file():
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{path} holds {', '.join(pickles)} but no {WEIGHTS_FILE}; pickle checkpoints are refused (unpickling can run code): "
                f"save it as safetensors where it is trusted (transformers: model.save_pretrained(folder, safe_serialization=True))"
            )
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}")
    if not (path / CONFIG_FILE).is_file():
        if (path / CONFIG_FILE).exists():
            raise CheckpointError(f"config file {path / CONFIG_FILE} is not a regular file (a FIFO, device or socket is never read); "
                                  "name a checkpoint folder whose config.json is a file")
        raise CheckpointError(f"{path} has no {CONFIG_FILE}")
    return path


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: ``model.safetensors``, or the shards its ``model.safetensors.index.json``
    names (each a file of the folder itself, named once)."""
    path = _checkpoint_dir(path)
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / WEIGHTS_INDEX
    try:
        weight_map = json.loads(read_regular(index, INDEX_BYTES, "index of shards").decode("utf-8")).get("weight_map")
    except RuntimeInputError as exc:
        raise CheckpointError(str(exc)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a readable index of shards ({exc})") from None
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor name -> shard file")
    shards = []
    for name in sorted(set(weight_map.values())):
        if Path(name).name != name or not name.endswith(".safetensors") or name.startswith("."):
            raise CheckpointError(f"{index} names the shard {name!r}; shards must be .safetensors files in the checkpoint folder itself")
        if not (path / name).is_file():
            raise CheckpointError(f"{index} names the shard {name}, which is not in {path}")
        shards.append(path / name)
    return shards


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A checkpoint folder read once: its path, ``config.json`` as a dict, its ``model_type`` (None for edgelin's own
    LinearLM), its weight files (``model.safetensors``, or the shards of an index) and, computed on first use, the
    sha256 of its weights (the manifest's ``source``). ``open_checkpoint`` makes one; loading, importing, the
    tokenizer's special ids and the export all read this value, not the folder again. It is a path-like of the folder."""

    path: Path
    config: dict[str, Any]
    model_type: str | None
    files: tuple[Path, ...]
    # a config without weights (``edgelin.importers.model_from_config``): the importer builds its model and the
    # weights are left at their initial values; nothing is read
    config_only: bool = False

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __str__(self) -> str:
        return str(self.path)

    @cached_property
    def sha256(self) -> str:
        return _files_sha256(self.path, self.files)


def open_checkpoint(path: "str | os.PathLike | Checkpoint") -> Checkpoint:
    """The checkpoint folder ``path`` read once into a ``Checkpoint`` (a Checkpoint is returned as it is).
    CheckpointError where it is not a checkpoint: no folder, no config.json, a pickle, no weights, a bad config."""
    if isinstance(path, Checkpoint):
        return path
    from edgelin.importers import check_supported, read_config

    folder = _checkpoint_dir(path)
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{folder / CONFIG_FILE}: 'model_type' must be a string, got {model_type!r}")
    if model_type is not None:
        check_supported(folder, model_type, config)
    return Checkpoint(folder, config, model_type, tuple(weight_files(folder)))


def weights_sha256(path: "str | Path | Checkpoint") -> str:
    """sha256 of the checkpoint's weights (the manifest's ``source``): of ``model.safetensors``, or of a sharded
    checkpoint's index followed by its shards in name order."""
    if isinstance(path, Checkpoint):
        return path.sha256
    return _files_sha256(Path(path), weight_files(path))


def _files_sha256(path: Path, files) -> str:
    files = list(files)
    if files[0].name != WEIGHTS_FILE:
        files = [Path(path) / WEIGHTS_INDEX, *files]
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _tensors(model: LinearLM) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.float32).contiguous().cpu() for n, t in model.state_dict().items()}


def model_sha256(model: LinearLM) -> str:
    """sha256 of the bytes ``save_checkpoint`` would write for ``model``'s weights: equal to
    ``weights_sha256`` of its saved checkpoint, so an in-memory model and its file have one identity."""
    from safetensors.torch import save

    return hashlib.sha256(save(_tensors(model), metadata=SAFETENSORS_METADATA)).hexdigest()


def load_config(path: str | Path) -> ModelConfig:
    path = _checkpoint_dir(path)
    try:
        return ModelConfig.load(path / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None


def load_checkpoint(path: "str | Path | Checkpoint") -> LinearLM:
    """Load a model (eval mode, float32, CPU) from a checkpoint folder (or a ``Checkpoint`` already read): a
    LinearLM, or, when config.json has a ``model_type``, the model its importer builds (edgelin.importers)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from edgelin.importers import import_checkpoint
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
    problems = shape_problems(expected_shapes(lambda: LinearLM(cfg), cfg), header_shapes(path / WEIGHTS_FILE))
    if problems:
        raise CheckpointError(f"{path}: weights do not match {CONFIG_FILE}: {'; '.join(problems)}")
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
