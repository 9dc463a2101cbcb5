"""The importer registry: ``model_type`` -> the function that builds its model, made from the catalog of families
(``edgelin.importers.catalog``). Torch-free: an importer's module (and torch) is imported only when it is called."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from edgelin.importers.catalog import FAMILIES

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

