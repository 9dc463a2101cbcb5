"""A checkpoint folder (``config.json`` + ``model.safetensors``, or the shards of an index) read once into a
``Checkpoint``, and refused where no importer reads it. Nothing is ever unpickled. Torch-free: loading and saving
edgelin's own models is ``edgelin.checkpoint``'s, building a foreign model ``edgelin.importers.import_checkpoint``."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from edgelin.errors import CheckpointError, RuntimeInputError, UnsupportedCheckpoint
from edgelin.importers.catalog import accepts, refusal
from edgelin.importers.registry import IMPORTERS
from edgelin.runtime.files import read_regular

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint (transformers' save_pretrained above its shard size)
CONFIG_BYTES = 16 << 20  # the largest config.json read (released configs are a few kB)
INDEX_BYTES = 64 << 20  # the largest model.safetensors.index.json read (a 1 B model's is ~50 kB)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a checkpoint folder, or CheckpointError saying why it is not one (checked before anything is read)."""
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
    path = checkpoint_dir(path)
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


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict (CheckpointError if unreadable or not a JSON object)."""
    file = Path(path) / CONFIG_FILE
    try:  # a regular file of bounded size: a FIFO would block, a huge file fill the memory
        data = json.loads(read_regular(file, CONFIG_BYTES, "config file").decode("utf-8"))
    except RuntimeInputError as exc:
        raise CheckpointError(str(exc)) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{file} is not UTF-8 text; save the config as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def check_supported(folder: Path, model_type: Any, config: dict[str, Any]) -> None:
    """UnsupportedCheckpoint, saying why and what to do, unless a registered importer reads this checkpoint: before
    anything else of the folder is read, so that a family edgelin cannot export is said first."""
    if not (isinstance(model_type, str) and model_type in IMPORTERS and accepts(model_type, config)):
        raise UnsupportedCheckpoint(f"{Path(folder) / CONFIG_FILE}: {refusal(str(model_type), config)}")


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
    folder = checkpoint_dir(path)
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


