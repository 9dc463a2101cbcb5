"""fla's delta-rule families' config reading: DeltaNet's and GatedDeltaNet's fields onto the layer of
edgelin.layers.delta (the family modules ``delta_net`` and ``gated_deltanet`` register them)."""

from __future__ import annotations

import math

from edgelin.importers.fields import Fields
from edgelin.importers.fla import Common
from edgelin.importers.fla.linear_attn import head_width
from edgelin.layers.delta import GATE_ACTIVATIONS, QK_ACTIVATIONS, QK_NORMS, DeltaOptions, FlaDeltaAttention


ATTN_MODES = ("chunk", "fused_recurrent")  # which of fla's kernels computes the same math: no effect here


def read_delta_net(f: Fields, common: Common) -> DeltaOptions:
    f.flag("use_output_norm")  # accepted, no effect: fla's DeltaNet layer ignores it (its output norm always runs)
    f.choice("attn_mode", ATTN_MODES)
    heads = f.integer("num_heads")
    return DeltaOptions(
        gated=False, num_heads=heads, num_v_heads=heads,
        head_k_dim=head_width(f, common, "expand_k", heads), head_v_dim=head_width(f, common, "expand_v", heads),
        short_conv=f.flag("use_short_conv"), conv_size=f.integer("conv_size"),
        qk_activation=f.choice("qk_activation", QK_ACTIVATIONS), qk_norm=f.choice("qk_norm", QK_NORMS),
        use_beta=f.flag("use_beta"), allow_neg_eigval=f.flag("allow_neg_eigval"), output_gate=f.flag("use_gate"),
        gate_activation="swish",
    )


def read_gated_deltanet(f: Fields, common: Common) -> DeltaOptions:
    f.choice("attn_mode", ATTN_MODES)
    heads, head_dim = f.integer("num_heads"), f.integer("head_dim")
    v_heads = f.integer("num_v_heads", optional=True) or heads
    if v_heads % heads:
        raise f.fail("num_v_heads", f"must be a multiple of num_heads ({heads}), got {v_heads}")
    width = head_dim * f.number("expand_v")
    if not math.isclose(width, round(width), rel_tol=0, abs_tol=1e-9):
        raise f.fail("expand_v", f"gives a value head width head_dim * expand_v = {width:g}; it must be an integer")
    return DeltaOptions(
        gated=True, num_heads=heads, num_v_heads=v_heads, head_k_dim=head_dim, head_v_dim=round(width),
        short_conv=f.flag("use_short_conv"), conv_size=f.integer("conv_size"), qk_activation="silu", qk_norm="l2",
        use_beta=True, allow_neg_eigval=f.flag("allow_neg_eigval"), output_gate=f.flag("use_gate"),
        gate_activation="sigmoid" if f.choice("output_gate_activation", GATE_ACTIVATIONS) == "sigmoid" else "swish",
    )


DELTA_FIELDS = {  # shared by DeltaNet and GatedDeltaNet (the defaults that differ are set per family)
    "attn_mode": "chunk", "use_gate": False, "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4,
}


__all__ = ["DELTA_FIELDS", "DeltaOptions", "FlaDeltaAttention", "read_delta_net", "read_gated_deltanet"]
