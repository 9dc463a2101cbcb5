"""Importers: models built from foreign checkpoint folders (``config.json`` with a ``model_type`` + ``model.safetensors``).

``IMPORTERS`` maps a ``model_type`` to a function ``(checkpoint) -> model``; every model it returns follows
edgelin's model protocol (``edgelin.protocol.ExportableModel``), so it exports, validates and generates like
edgelin's own ``LinearLM``. Importers are loaded on first use: importing this package does not import torch.

Adding a family: write a function ``(checkpoint) -> model`` -- it is given an ``edgelin.checkpoint.Checkpoint``, the
folder read once (``open_checkpoint(path)`` returns that as it is, and makes one from a plain path) -- and add the
family to ``edgelin.importers.catalog.FAMILIES`` (its model_types, classes, layer kinds and importer), from which it
is registered here and listed by ``edgelin models``, ``edgelin export --help`` and the README. Every importer builds the one model skeleton (``edgelin.skeleton.CausalLM``) with its
mixers; flash-linear-attention families are one module each in ``edgelin.importers.fla`` and share its config
reading (``edgelin.importers.fields``) and weight matching (``edgelin.importers.weights``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

from edgelin.errors import CheckpointError, RuntimeInputError, UnsupportedCheckpoint
from edgelin.importers.catalog import FAMILIES, accepts, refusal
from edgelin.runtime.files import read_regular

CONFIG_FILE = "config.json"

Importer = Callable[[Any], Any]  # (edgelin.checkpoint.Checkpoint) -> an ExportableModel
IMPORTERS: dict[str, Importer] = {}
# model_type -> the framework whose own model the checkpoint is ("transformers", "fla"): what
# ``edgelin validate --upstream`` runs as the reference (edgelin.upstream)
FRAMEWORKS: dict[str, str] = {}


def register_importer(model_type: str, importer: Importer, framework: str | None = None) -> None:
    IMPORTERS[model_type] = importer
    if framework is not None:
        FRAMEWORKS[model_type] = framework


def _lazy(module: str, name: str) -> Importer:
    """An importer that imports ``module`` (and torch) only when it is called."""

    def load(path: Path) -> Any:
        return getattr(importlib.import_module(module), name)(path)

    load.__name__ = load.__qualname__ = f"{module}.{name}"
    return load


# one registration per model_type, from the catalog of families (edgelin.importers.catalog)
for _f in FAMILIES:
    for _type, _function in zip(_f.model_types, _f.functions):
        register_importer(_type, _lazy(_f.module, _function), _f.framework)


def supported() -> tuple[str, ...]:
    return tuple(sorted(IMPORTERS))


CONFIG_BYTES = 16 << 20  # the largest config.json read (released configs are a few kB)


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


def foreign_model_type(path: str | Path) -> str | None:
    """The ``model_type`` of a foreign checkpoint folder, or None for an edgelin checkpoint (no such key). A
    ``edgelin.checkpoint.Checkpoint`` says it without reading the folder again."""
    if hasattr(path, "model_type") and hasattr(path, "config"):
        return path.model_type
    model_type = read_config(path).get("model_type")
    if model_type is None:
        return None
    if not isinstance(model_type, str):
        raise CheckpointError(f"{Path(path) / CONFIG_FILE}: 'model_type' must be a string, got {model_type!r}")
    return model_type


def model_from_config(config: dict[str, Any], where: str = "the config") -> Any:
    """The model a foreign checkpoint with this ``config.json`` content would import to, with its weights as
    initialised (the caller seeds torch): for measuring speed where only an export's manifest (its
    ``source_config``) is at hand. The importer reads and checks the config exactly as for a checkpoint."""
    from edgelin.checkpoint import Checkpoint

    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise CheckpointError(f"{where} has no model_type naming an importer")
    return import_checkpoint(Checkpoint(Path(where), config, model_type, (), config_only=True))


def check_supported(folder: Path, model_type: Any, config: dict[str, Any]) -> None:
    """UnsupportedCheckpoint, saying why and what to do, unless a registered importer reads this checkpoint: before
    anything else of the folder is read, so that a family edgelin cannot export is said first."""
    if not (isinstance(model_type, str) and model_type in IMPORTERS and accepts(model_type, config)):
        raise UnsupportedCheckpoint(f"{Path(folder) / CONFIG_FILE}: {refusal(str(model_type), config)}")


def import_checkpoint(path: Any) -> Any:
    """Build the model of a foreign checkpoint folder (or ``edgelin.checkpoint.Checkpoint``, read once) with the
    importer registered for its ``model_type``; the importer is given the Checkpoint."""
    from edgelin.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    check_supported(ckpt.path, ckpt.model_type, ckpt.config)
    importer = IMPORTERS[ckpt.model_type]
    return importer(ckpt)


__all__ = ["FAMILIES", "FRAMEWORKS", "IMPORTERS", "check_supported", "Importer", "foreign_model_type", "import_checkpoint", "model_from_config", "read_config", "register_importer", "supported"]
