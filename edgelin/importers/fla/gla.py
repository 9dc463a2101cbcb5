"""fla's ``gla`` (GLAForCausalLM: GatedLinearAttention, a data-dependent decay per key feature); the mixer is
edgelin.importers.fla.gated's. Hybrids: the ``attn`` field (edgelin.importers.fla)."""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.gated import GATED_FIELDS, FlaGatedAttention, gated_renames, read_gla
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/gla",
    fields={
        **GATED_FIELDS, "expand_k": 0.5, "expand_v": 1.0, "num_heads": 4, "hidden_ratio": 4, "clamp_min": None,
        "use_gk": True, "use_gv": False,
    },
    read=read_gla,
    make_layer=FlaGatedAttention,
    renames=gated_renames,
    chunk_size=32,  # the per-feature decay's intra-chunk tensor is T x C x Dk per head (see edgelin.ops.chunk)
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
