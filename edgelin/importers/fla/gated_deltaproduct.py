"""fla's ``gated_deltaproduct`` (GatedDeltaProductForCausalLM: num_householder delta-rule steps per token after one
gate per head); the mixer is edgelin.importers.fla.delta's. Hybrids: the ``attn`` field (edgelin.importers.fla).

fla's GatedDeltaProduct model builds its layers without value-head groups (its config has no num_v_heads).
``attn_mode`` is accepted without effect (which of fla's kernels computes the same math).
"""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.delta import FlaDeltaAttention, read_gated_deltaproduct
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/gated_deltaproduct",
    fields={
        "attn_mode": "chunk", "conv_size": 4, "head_dim": 256, "num_heads": 6, "expand_v": 2.0, "use_output_gate": True,
        "use_short_conv": True, "use_forget_gate": False, "allow_neg_eigval": False, "num_householder": 1,
    },
    read=read_gated_deltaproduct,
    make_layer=FlaDeltaAttention,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
