"""fla's ``delta_net`` (DeltaNetForCausalLM: the delta rule, no decay); the mixer is edgelin.importers.fla.delta's.
Hybrids: the ``attn`` field (edgelin.importers.fla)."""

from __future__ import annotations

from pathlib import Path

from edgelin.importers.fla import Family, load_fla
from edgelin.importers.fla.delta import DELTA_FIELDS, FlaDeltaAttention, read_delta_net
from edgelin.skeleton import CausalLM

FAMILY = Family(
    name="fla/delta_net",
    fields={
        **DELTA_FIELDS, "expand_k": 1.0, "expand_v": 1.0, "num_heads": 16, "use_beta": True, "use_output_norm": True,
        "qk_norm": "l2", "qk_activation": "silu",
    },
    read=read_delta_net,
    make_layer=FlaDeltaAttention,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "load"]
