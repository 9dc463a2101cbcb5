"""fla's ``linear_attn`` (LinearAttentionForCausalLM): its config read onto the layer of edgelin.layers.linear_attention
(kind "fla/linear_attn", fla's feature maps and conventions).

fla's conventions are the layer's (its module docstring; docs/importers.md). Here only the config:
- MLP width: ``intermediate_size``, or hidden * hidden_ratio * 2/3 rounded up to a multiple of 256.
"""

from __future__ import annotations

import math
from pathlib import Path

from edgelin.importers.fields import Fields
from edgelin.importers.fla import Common, Family, load_fla
from edgelin.layers.linear_attention import FlaLinearAttention, LinearAttnOptions
from edgelin.skeleton import CausalLM

# fla's feature_map value -> edgelin's registry name
LINEAR_ATTN_MAPS = {
    "identity": "identity", "elu": "elu+1", "relu": "relu",
    "elementwise_product": "elementwise_product", "hedgehog": "hedgehog", "t2r": "t2r", "dpfp": "dpfp",
}
def read_heads(f: Fields, common: Common) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_k_dim, head_v_dim) from num_heads, num_kv_heads, expand_k, expand_v."""
    heads = f.integer("num_heads")
    kv_heads = f.integer("num_kv_heads", optional=True) or heads
    if heads % kv_heads:
        raise f.fail("num_kv_heads", f"must divide num_heads ({heads}), got {kv_heads}")
    return heads, kv_heads, head_width(f, common, "expand_k", heads), head_width(f, common, "expand_v", heads)


def head_width(f: Fields, common: Common, name: str, heads: int) -> int:
    """hidden_size * f[name] / heads: the width of one head, refused unless a whole number."""
    width = common.hidden_size * f.number(name)
    if not math.isclose(width, round(width)) or round(width) % heads:
        raise f.fail(name, f"gives a width hidden_size * {name} = {width:g}; it must be an integer divisible by num_heads ({heads})")
    return round(width) // heads


def read_linear_attn(f: Fields, common: Common) -> LinearAttnOptions:
    heads, kv_heads, head_k_dim, head_v_dim = read_heads(f, common)
    fm = f.get("feature_map")
    if fm not in LINEAR_ATTN_MAPS:
        raise f.fail("feature_map", f"is {fm!r}; edgelin supports {', '.join(map(repr, LINEAR_ATTN_MAPS))}")
    return LinearAttnOptions(
        num_heads=heads, num_kv_heads=kv_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        feature_map=LINEAR_ATTN_MAPS[fm], tie_qk=f.flag("tie_feature_map_qk"), norm_q=f.flag("norm_q"),
        norm_k=f.flag("norm_k"), normalize=f.flag("norm_feature_map"), elementwise_affine=f.flag("elementwise_affine"),
    )


def linear_attn_renames(o: LinearAttnOptions) -> list[tuple[str, str]]:
    if o.feature_map not in ("elementwise_product", "hedgehog", "t2r"):  # no parameters
        return []
    # tied maps are one module saved under either name (or both)
    return [(".attn.feature_map_q.", ".attn.phi.inner.q."), (".attn.feature_map_k.", ".attn.phi.inner.q." if o.tie_qk else ".attn.phi.inner.k.")]


FAMILY = Family(
    name="fla/linear_attn",
    fields={
        "expand_k": 1.0, "expand_v": 1.0, "num_heads": 4, "num_kv_heads": None, "feature_map": "elementwise_product",
        "tie_feature_map_qk": False, "norm_q": False, "norm_k": False, "norm_feature_map": False,
        "elementwise_affine": True,
        "attn_mode": "fused_chunk",  # which fla kernel runs the same math: no effect here
    },
    read=read_linear_attn,
    make_layer=FlaLinearAttention,
    renames=linear_attn_renames,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "FlaLinearAttention", "LinearAttnOptions", "head_width", "load", "read_heads"]
