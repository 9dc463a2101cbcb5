"""fla's ``retnet`` (RetNetForCausalLM: MultiScaleRetention, a fixed decay per head with rotary positions); the mixer is
edgelin.importers.fla.gated's. Hybrids: the ``attn`` field (edgelin.importers.fla)."""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.gated import GATED_FIELDS, FlaGatedAttention, gated_renames, read_retnet
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/retnet",
    fields={**GATED_FIELDS, "expand_k": 1.0, "expand_v": 2.0, "num_heads": 8, "hidden_ratio": 2},
    read=read_retnet,
    make_layer=FlaGatedAttention,
    renames=gated_renames,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
