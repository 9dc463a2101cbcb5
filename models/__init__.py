"""edgelin.models: bundled checkpoints (config.json + model.safetensors + a model card), as package data."""

from __future__ import annotations

from pathlib import Path

BUNDLED = "stdlib-linear"  # the folder of the default bundled checkpoint


def bundled_checkpoint(name: str = BUNDLED) -> Path | None:
    """The folder of a bundled checkpoint, or None when this install has none."""
    path = Path(__file__).resolve().parent / name
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    return None
