"""fla's delta-rule families' config reading: DeltaNet's, GatedDeltaNet's, KDA's and Gated DeltaProduct's fields onto
the layer of edgelin.layers.delta (the family modules ``delta_net``, ``gated_deltanet``, ``kda`` and
``gated_deltaproduct`` register them)."""

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


def value_heads(f: Fields, heads: int) -> int:
    """``num_v_heads`` (null: num_heads), a multiple of num_heads (grouped value heads)."""
    v_heads = f.integer("num_v_heads", optional=True) or heads
    if v_heads % heads:
        raise f.fail("num_v_heads", f"must be a multiple of num_heads ({heads}), got {v_heads}")
    return v_heads


def value_width(f: Fields, head_dim: int) -> int:
    """The value head width head_dim * expand_v, which must be an integer."""
    width = head_dim * f.number("expand_v")
    if not math.isclose(width, round(width), rel_tol=0, abs_tol=1e-9):
        raise f.fail("expand_v", f"gives a value head width head_dim * expand_v = {width:g}; it must be an integer")
    return round(width)


def read_gated_deltanet(f: Fields, common: Common) -> DeltaOptions:
    f.choice("attn_mode", ATTN_MODES)
    heads, head_dim = f.integer("num_heads"), f.integer("head_dim")
    v_heads = value_heads(f, heads)
    width = value_width(f, head_dim)
    return DeltaOptions(
        gated=True, num_heads=heads, num_v_heads=v_heads, head_k_dim=head_dim, head_v_dim=width,
        short_conv=f.flag("use_short_conv"), conv_size=f.integer("conv_size"), qk_activation="silu", qk_norm="l2",
        use_beta=True, allow_neg_eigval=f.flag("allow_neg_eigval"), output_gate=f.flag("use_gate"),
        gate_activation="sigmoid" if f.choice("output_gate_activation", GATE_ACTIVATIONS) == "sigmoid" else "swish",
    )


def read_kda(f: Fields, common: Common) -> DeltaOptions:
    """Kimi Delta Attention (fla's KimiDeltaAttention): the gated delta rule with a decay per key channel from the
    bottleneck f_proj, the output gate a bottleneck g_proj under a sigmoid, beta and the q/k L2 norm always on."""
    f.choice("attn_mode", ATTN_MODES)
    heads, head_dim = f.integer("num_heads"), f.integer("head_dim")
    width = value_width(f, head_dim)
    bound = f.get("lower_bound")
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float)) or not -math.inf < bound < 0):
        raise f.fail("lower_bound", f"must be a negative number (the gate's lower bound in log space) or null, got {bound!r}")
    if f.flag("safe_gate") and bound is None:  # a kernel hint (fla's chunk kernel may assume g in [lower_bound, 0))
        raise f.fail("safe_gate", "is true without a lower_bound, which fla requires; set lower_bound (e.g. -5) or false")
    return DeltaOptions(
        gated=True, num_heads=heads, num_v_heads=value_heads(f, heads), head_k_dim=head_dim, head_v_dim=width,
        short_conv=f.flag("use_short_conv"), conv_size=f.integer("conv_size"), qk_activation="silu", qk_norm="l2",
        use_beta=True, allow_neg_eigval=f.flag("allow_neg_eigval"), output_gate=True, gate_activation="sigmoid",
        channel_decay=True, gate_rank=width, decay_lower_bound=None if bound is None else float(bound),
    )


def read_gated_deltaproduct(f: Fields, common: Common) -> DeltaOptions:
    """Gated DeltaProduct (fla's GatedDeltaProduct): num_householder delta steps per token after one per-head gate
    (use_forget_gate; without it no decay), the output gate under swish (use_output_gate), beta and the L2 norm on."""
    f.choice("attn_mode", ATTN_MODES)
    heads, head_dim = f.integer("num_heads"), f.integer("head_dim")
    return DeltaOptions(
        gated=f.flag("use_forget_gate"), num_heads=heads, num_v_heads=heads, head_k_dim=head_dim,
        head_v_dim=value_width(f, head_dim), short_conv=f.flag("use_short_conv"), conv_size=f.integer("conv_size"),
        qk_activation="silu", qk_norm="l2", use_beta=True, allow_neg_eigval=f.flag("allow_neg_eigval"),
        output_gate=f.flag("use_output_gate"), gate_activation="swish", householder=f.integer("num_householder"),
    )


DELTA_FIELDS = {  # shared by DeltaNet and GatedDeltaNet (the defaults that differ are set per family)
    "attn_mode": "chunk", "use_gate": False, "use_short_conv": True, "allow_neg_eigval": False, "conv_size": 4,
}


__all__ = [
    "DELTA_FIELDS", "DeltaOptions", "FlaDeltaAttention", "read_delta_net", "read_gated_deltanet", "read_gated_deltaproduct",
    "read_kda", "value_heads", "value_width",
]
