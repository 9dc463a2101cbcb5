"""fla's ``gated_deltanet`` (GatedDeltaNetForCausalLM: the gated delta rule, grouped value heads); the mixer is
edgelin.importers.fla.delta's. Hybrids: the ``attn`` field (edgelin.importers.fla)."""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.delta import DELTA_FIELDS, FlaDeltaAttention, read_gated_deltanet
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/gated_deltanet",
    fields={
        **DELTA_FIELDS, "use_gate": True, "expand_v": 2.0, "head_dim": 256, "num_heads": 6, "num_v_heads": None,
        "output_gate_activation": "swish",
    },
    read=read_gated_deltanet,
    make_layer=FlaDeltaAttention,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
