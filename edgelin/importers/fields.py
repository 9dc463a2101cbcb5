"""Typed, refusing reads of a checkpoint's config.json: the config-field framework every importer shares.

An importer lists the fields it knows with their defaults; ``check_fields`` refuses any other field (it may change
the model) and any refused option that is set, naming the field, and returns ``Fields``: typed reads whose every
error names the field and the file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edgelin.errors import CheckpointError, UnsupportedCheckpoint
from edgelin.importers.catalog import NEXT_STEP

# Fields of any HF-style config that do not change what the model computes.
GENERIC_FIELDS = frozenset({
    "model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "max_position_embeddings",
    "return_dict", "output_hidden_states", "output_attentions", "use_return_dict", "tokenizer_class",
    "id2label", "label2id", "problem_type", "is_encoder_decoder", "keys_to_ignore_at_inference",
})

class Fields:
    """Typed reads of a config dict with a family's defaults; every error names the field."""

    def __init__(self, data: dict[str, Any], defaults: dict[str, Any], where: Path) -> None:
        self.data, self.defaults, self.where = data, defaults, where

    def fail(self, name: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: config field {name!r} {message}")

    def get(self, name: str) -> Any:
        return self.data.get(name, self.defaults[name])

    def integer(self, name: str, *, optional: bool = False) -> int | None:
        value = self.get(name)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.fail(name, f"must be a positive integer{' or null' if optional else ''}, got {value!r}")
        return value

    def number(self, name: str) -> float:
        value = self.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
            raise self.fail(name, f"must be a positive finite number, got {value!r}")
        return float(value)

    def flag(self, name: str) -> bool:
        value = self.get(name)
        if not isinstance(value, bool):
            raise self.fail(name, f"must be true or false, got {value!r}")
        return value

    def unsupported(self, name: str, message: str) -> UnsupportedCheckpoint:
        """A refusal of something the checkpoint asks for that edgelin does not implement (not a malformed value):
        the message says what, and the next step is added."""
        return UnsupportedCheckpoint(f"{self.where}: config field {name!r} {message}. {NEXT_STEP}")

    def choice(self, name: str, allowed: tuple[str, ...]) -> str:
        value = self.get(name)
        if value not in allowed:
            raise self.fail(name, f"is {value!r}; edgelin supports {', '.join(map(repr, allowed))}")
        return value


def check_fields(
    data: dict[str, Any], *, defaults: dict[str, Any], refused: dict[str, str], importer: str, where: Path
) -> Fields:
    """Refuse an unknown field or a set refused option, naming the field; return typed access to the rest.
    ``defaults``: every field the importer reads, with its default; ``refused``: field -> what it would turn on."""
    known = GENERIC_FIELDS | set(defaults) | set(refused)
    unknown = sorted(set(data) - known)
    if unknown:
        named = ", ".join(map(repr, unknown[:12])) + (f" and {len(unknown) - 12} more" if len(unknown) > 12 else "")
        plural = "s" if len(unknown) > 1 else ""
        raise UnsupportedCheckpoint(
            f"{where}: config field{plural} {named} {'are' if plural else 'is'} unknown to edgelin's {importer} importer; "
            f"{'they' if plural else 'it'} may change the model, so the checkpoint is refused (docs/importers.md lists the "
            f"fields each family reads; if you know {'they do' if plural else 'it does'} not change the model, remove "
            f"{'them' if plural else 'it'} from {where.name} and export again)"
        )
    set_options = [(name, what) for name, what in refused.items() if data.get(name) is not None]
    if set_options:
        said = "; ".join(f"{name!r} ({what})" for name, what in set_options)
        raise UnsupportedCheckpoint(f"{where}: config field{'s' if len(set_options) > 1 else ''} {said} "
                                    f"{'are' if len(set_options) > 1 else 'is'} set; edgelin does not support it yet. {NEXT_STEP}")
    return Fields(data, {**{name: None for name in refused}, **defaults}, where)


__all__ = ["Fields", "GENERIC_FIELDS", "check_fields"]
