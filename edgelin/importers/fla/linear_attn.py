"""fla's ``linear_attn`` (LinearAttentionForCausalLM): a linear-attention mixer with fla's feature maps.

Conventions of fla, carried over exactly (see docs/importers.md):
- q goes through the feature map, then (``norm_q``) phi(q) / (sum phi(q) + 1e-4), then times F^-0.5, where F is
  the feature width (2 D for hedgehog, 8 D for dpfp); keys likewise without the scale (``norm_k``).
- With ``norm_feature_map`` the output is divided by the running denominator with fla's epsilon 1e-10 added
  to the *scaled* denominator; without it there is no denominator. A per-head RMSNorm (weight only with
  ``elementwise_affine``) always follows.
- ``num_kv_heads``: query head h reads key/value head h // (num_heads / num_kv_heads). Every query head of a
  group would build the same state, so the state is carried once per key/value head.
- MLP width: ``intermediate_size``, or hidden * hidden_ratio * 2/3 rounded up to a multiple of 256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from edgelin.feature_maps import Adjusted, FeatureMap, make_feature_map
from edgelin.importers.fields import Fields
from edgelin.importers.fla import Common, Family, load_fla, share_state, split_heads, unshare_state
from edgelin.ops import FORMS, State, recurrent_step, state_layout
from edgelin.skeleton import CausalLM, RMSNorm, check_form, fixed_norm, register_mixer

# fla's feature_map value -> edgelin's registry name
LINEAR_ATTN_MAPS = {
    "identity": "identity", "elu": "elu+1", "relu": "relu",
    "elementwise_product": "elementwise_product", "hedgehog": "hedgehog", "t2r": "t2r", "dpfp": "dpfp",
}
FLA_DENOMINATOR_EPS = 1e-10  # added to the scaled denominator
# The ONNX exporter's graph optimizer drops an added constant below 1e-8 as if it were zero (measured with
# torch 2.13 + onnxscript 0.7.2), which would turn 0 / 0 into NaN where the denominator is exactly zero (dpfp's
# sparse features make that happen). With the denominator, q is scaled by a further 2^14: numerator and
# denominator grow alike (exactly, a power of two), and the epsilon becomes 2^14 * 1e-10 = 1.6e-6.
DENOMINATOR_GAIN = 2.0**14
FLA_SUM_NORM_EPS = 1e-4  # norm_q / norm_k: phi / (sum phi + 1e-4)


@dataclass(frozen=True)
class LinearAttnOptions:
    num_heads: int
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    feature_map: str  # edgelin's registry name
    tie_qk: bool
    norm_q: bool
    norm_k: bool
    normalize: bool  # norm_feature_map: divide by the running denominator
    elementwise_affine: bool


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


@register_mixer("fla/linear_attn")
class FlaLinearAttention(nn.Module):
    """fla's LinearAttention layer on edgelin's forms; the state is carried per key/value head."""

    forms = ("chunk", "step")
    accepts_lengths = False
    bounded_state = False  # a plain running sum

    def __init__(self, o: LinearAttnOptions, common: Common) -> None:
        super().__init__()
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        hidden = common.hidden_size
        self.q_proj = nn.Linear(hidden, o.num_heads * o.head_k_dim, bias=False)
        self.k_proj = nn.Linear(hidden, o.num_kv_heads * o.head_k_dim, bias=False)
        self.v_proj = nn.Linear(hidden, o.num_kv_heads * o.head_v_dim, bias=False)
        self.o_proj = nn.Linear(o.num_heads * o.head_v_dim, hidden, bias=False)
        inner: FeatureMap = make_feature_map(o.feature_map, o.head_k_dim, tie_qk=o.tie_qk)
        gain = DENOMINATOR_GAIN if o.normalize else 1.0
        self.eps = FLA_DENOMINATOR_EPS * gain
        self.phi = Adjusted(
            inner, query_scale=inner.out_dim**-0.5 * gain, sum_norm_query=o.norm_q, sum_norm_key=o.norm_k,
            sum_eps=FLA_SUM_NORM_EPS,
        )
        self.norm = RMSNorm(o.head_v_dim, common.norm_eps)
        if not o.elementwise_affine:  # fla's output norm then has no weight: a fixed 1, not in the checkpoint
            fixed_norm(self.norm)

    def state_layout(self) -> dict[str, tuple]:
        return state_layout(self.phi, n_heads=self.o.num_kv_heads, value_dim=self.o.head_v_dim, normalize=self.o.normalize)

    def _heads(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return split_heads(x, heads, dim, self.groups if heads != self.o.num_heads else 1)  # [B, H, T, dim]

    def _share(self, state: State) -> State:
        return share_state(state, self.groups)

    def _unshare(self, state: State) -> State:
        return unshare_state(state, self.groups)

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """"chunk" (the prefill graph, fla's chunked form) or "step" (one token, the decode graph)."""
        check_form(self, form, lengths)
        o = self.o
        q = self._heads(self.q_proj(x), o.num_heads, o.head_k_dim)  # [B, H, T, Dk]
        k = self._heads(self.k_proj(x), o.num_kv_heads, o.head_k_dim)  # [B, H, T, Dk]
        v = self._heads(self.v_proj(x), o.num_kv_heads, o.head_v_dim)  # [B, H, T, Dv]
        common = dict(feature_map=self.phi, initial_state=self._share(state), eps=self.eps, normalize=o.normalize)
        if form == "step":
            y, state = recurrent_step(q, k, v, **common)  # [B, H, 1, Dv]
        else:
            y, state = FORMS["chunk"](q, k, v, chunk_size=chunk_size, **common)  # [B, H, T, Dv]
        y = self.norm(y)
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D)), self._unshare(state)  # [B, T, hidden]


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
