"""Importers: models built from foreign checkpoint folders (``config.json`` with a ``model_type`` + ``model.safetensors``).

``IMPORTERS`` maps a ``model_type`` to a function ``(checkpoint) -> model``; every model it returns follows
edgelin's model protocol (``edgelin.protocol.ExportableModel``), so it exports, validates and generates like
edgelin's own ``LinearLM``. Importers are loaded on first use: importing this package does not import torch.

Adding a family: write a function ``(checkpoint) -> model`` -- it is given a ``Checkpoint``
(``edgelin.importers.folder``), the folder read once (``open_checkpoint(path)`` returns that as it is, and makes
one from a plain path) -- and add the family to ``edgelin.importers.catalog.FAMILIES`` (its model_types, classes,
layer kinds and importer), from which it is registered (``edgelin.importers.registry``) and listed by ``edgelin
models``, ``edgelin export --help`` and the README. Every importer builds the one model skeleton
(``edgelin.skeleton.CausalLM``) with its mixers; flash-linear-attention families are one module each in
``edgelin.importers.fla`` and share its config reading (``edgelin.importers.fields``) and weight matching
(``edgelin.importers.weights``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.errors import CheckpointError
from edgelin.importers.catalog import FAMILIES
from edgelin.importers.folder import CONFIG_FILE, Checkpoint, check_supported, open_checkpoint, read_config
from edgelin.importers.registry import FRAMEWORKS, IMPORTERS, Importer, register_importer, supported


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
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        raise CheckpointError(f"{where} has no model_type naming an importer")
    return import_checkpoint(Checkpoint(Path(where), config, model_type, (), config_only=True))


def import_checkpoint(path: Any) -> Any:
    """Build the model of a foreign checkpoint folder (or ``edgelin.checkpoint.Checkpoint``, read once) with the
    importer registered for its ``model_type``; the importer is given the Checkpoint."""
    ckpt = open_checkpoint(path)
    check_supported(ckpt.path, ckpt.model_type, ckpt.config)
    importer = IMPORTERS[ckpt.model_type]
    return importer(ckpt)


__all__ = ["FAMILIES", "FRAMEWORKS", "IMPORTERS", "check_supported", "Importer", "foreign_model_type", "import_checkpoint", "model_from_config", "read_config", "register_importer", "supported"]
