"""fla's ``kda`` (KDAForCausalLM: Kimi Delta Attention, the gated delta rule with a decay per key channel); the
mixer is edgelin.importers.fla.delta's. Hybrids: the ``attn`` field (edgelin.importers.fla).

Accepted without effect: ``attn_mode`` (which of fla's kernels computes the same math) and ``safe_gate`` (a hint
to fla's chunk kernel that the gates lie in [lower_bound, 0); the gate's formula is chosen by ``lower_bound``
alone, in both of fla's kernels). The prefill chunk is 32 tokens: the per-channel decays inside a chunk take
T x C x K elements per head (edgelin.ops.delta).
"""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.delta import FlaDeltaAttention, read_kda
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/kda",
    fields={
        "attn_mode": "chunk", "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4, "expand_v": 1.0,
        "head_dim": 128, "num_heads": 16, "num_v_heads": None, "safe_gate": False, "lower_bound": None,
    },
    read=read_kda,
    make_layer=FlaDeltaAttention,
    chunk_size=32,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
