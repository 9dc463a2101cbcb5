"""fla's gated families' config reading: RetNet's and GLA's fields onto the layer of edgelin.layers.gated (the family
modules ``retnet`` and ``gla`` register them)."""

from __future__ import annotations

import math

from edgelin.importers.fields import Fields
from edgelin.importers.fla import Common
from edgelin.importers.fla.linear_attn import read_heads
from edgelin.layers.gated import GATED_FEATURE_MAPS, FlaGatedAttention, GatedOptions


def read_feature_activation(f: Fields) -> str | None:
    fm = f.get("feature_map")
    if fm not in GATED_FEATURE_MAPS:
        allowed = ", ".join(repr(n) for n in GATED_FEATURE_MAPS if n is not None)
        raise f.fail("feature_map", f"is {fm!r}; edgelin supports null, {allowed}")
    return fm


def read_retnet(f: Fields, common: Common) -> GatedOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    if head_k_dim % 2 or head_k_dim > 256:
        raise f.fail("expand_k", f"gives a key head width of {head_k_dim}; fla's rotary needs an even width <= 256")
    f.flag("use_short_conv")  # fla's RetNet model does not pass it (nor conv_size) to its layer: no convs
    f.integer("conv_size")
    return GatedOptions(
        decay="fixed", num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=read_feature_activation(f), output_gate=f.flag("use_output_gate"),
        elementwise_affine=f.flag("elementwise_affine"),
    )


def read_gla(f: Fields, common: Common) -> GatedOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    clamp = f.get("clamp_min")
    if clamp is not None and (isinstance(clamp, bool) or not isinstance(clamp, (int, float)) or not (clamp < 0 and math.isfinite(clamp))):
        raise f.fail("clamp_min", f"must be a negative finite number or null, got {clamp!r}")
    f.flag("use_gk")  # fla's GLA model does not pass use_gk / use_gv to its layer: always the key gate only
    f.flag("use_gv")
    return GatedOptions(
        decay="gla", num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=read_feature_activation(f), output_gate=f.flag("use_output_gate"),
        elementwise_affine=f.flag("elementwise_affine"), short_conv=f.flag("use_short_conv"),
        conv_size=f.integer("conv_size"), clamp_min=None if clamp is None else float(clamp),
    )


def gated_renames(o: GatedOptions) -> list[tuple[str, str]]:
    # with the output gate and fuse_norm, fla fuses the norm and the gate into one module of another name
    return [(".attn.g_norm_swish_gate.", ".attn.g_norm.")]


GATED_FIELDS = {  # shared by RetNet and GLA (the defaults that differ are set per family)
    "num_kv_heads": None, "feature_map": None, "use_short_conv": False, "conv_size": 4, "use_output_gate": True,
    "elementwise_affine": True,
    "attn_mode": "chunk",  # which fla kernel runs the same math: no effect here
}


__all__ = ["GATED_FIELDS", "FlaGatedAttention", "GatedOptions", "gated_renames", "read_feature_activation", "read_gla", "read_retnet"]
