"""Gated linear attention (kind "fla/gated"): fla's MultiScaleRetention (RetNet: a fixed decay per head, rotary
positions) and GatedLinearAttention (GLA: a data-dependent decay per key channel, optional short convs), on the
linear-attention forms of edgelin.ops with their log-decay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.attention import rotate
from edgelin.layers.feature_maps import Adjusted, make_feature_map
from edgelin.layers.heads import share_state, split_heads, unshare_state
from edgelin.layers.norms import RMSNorm, fixed_norm
from edgelin.layers.short_conv import WindowConv, conv_qkv
from edgelin.ops import FORMS, State, recurrent_step


# fla's feature_map for RetNet and GLA: an activation on q and k (None: none), before the rotary (RetNet) and
# before the kernel's K^-0.5 query scale. Both families' activation tables give these the same functions.
GATED_FEATURE_MAPS: dict[str | None, Callable[[torch.Tensor], torch.Tensor] | None] = {
    None: None, "relu": torch.relu, "sigmoid": torch.sigmoid, "swish": F.silu, "silu": F.silu,
}


GLA_GATE_NORMALIZER = 16  # fla's GatedLinearAttention default; its model does not pass the config's


GLA_GATE_RANK = 16  # the low-rank gate projection's width (likewise fixed by the model)


ROTARY_BASE = 10000.0


@dataclass(frozen=True)
class GatedOptions:
    """The attention layer of fla's RetNet (``decay="fixed"``) or GLA (``decay="gla"``)."""

    decay: str  # "fixed": gamma_h = 1 - 2^(-5-h) per head, with rotary positions; "gla": the data-dependent gate
    num_heads: int
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    feature_map: str | None  # a GATED_FEATURE_MAPS key
    output_gate: bool  # g_proj: RMSNorm(o) * swish(g_proj(x)); else RMSNorm(o)
    elementwise_affine: bool
    short_conv: bool = False  # GLA: depthwise causal convs (+ SiLU) after the q, k, v projections
    conv_size: int = 4
    clamp_min: float | None = None  # GLA: lower bound of the log-gate


# fla's ShortConvolution at inference (the window layout of fla's cache); edgelin.layers.short_conv has the math
FlaShortConv = WindowConv


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """log(sigmoid(x)) without log(0): min(x, 0) - log(1 + exp(-|x|))."""
    return torch.clamp(x, max=0.0) - torch.log1p(torch.exp(-x.abs()))


@register_mixer("fla/gated")
class FlaGatedAttention(nn.Module):
    """fla's MultiScaleRetention (RetNet) and GatedLinearAttention (GLA) on edgelin's forms, with the ops'
    log-decay g: per head for RetNet (log gamma_h), per key feature for GLA (the gate).

    q (and k) go through the optional activation, RetNet's rotary, then q is scaled by head_k_dim^-0.5; the
    attention has no denominator. The output is a per-head RMSNorm, times swish(g_proj(x)) with the output gate.
    State per layer: S [B, Hs, Dk, Dv] (Hs = num_heads for RetNet, whose decay differs per query head; the key/value
    heads for GLA, whose state is the same for every query head of a group), RetNet's position "pos" [B] int64
    (the rotary offset), GLA's conv windows "conv_q" / "conv_k" / "conv_v" [B, D, W]."""

    forms = ("chunk", "step")
    accepts_lengths = False
    bounded_state = True  # RetNet's and GLA's states decay

    def __init__(self, o: GatedOptions, common: Any) -> None:  # common: hidden_size, norm_eps (edgelin.layers.LayerSizes, fla's Common)
        super().__init__()
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        hidden = common.hidden_size
        key, kv_key, kv_value = o.num_heads * o.head_k_dim, o.num_kv_heads * o.head_k_dim, o.num_kv_heads * o.head_v_dim
        self.q_proj = nn.Linear(hidden, key, bias=False)
        self.k_proj = nn.Linear(hidden, kv_key, bias=False)
        self.v_proj = nn.Linear(hidden, kv_value, bias=False)
        if o.output_gate:
            self.g_proj = nn.Linear(hidden, o.num_heads * o.head_v_dim, bias=False)
        if o.short_conv:
            self.q_conv1d = FlaShortConv(key, o.conv_size)
            self.k_conv1d = FlaShortConv(kv_key, o.conv_size)
            self.v_conv1d = FlaShortConv(kv_value, o.conv_size)
        if o.decay == "gla":
            self.gk_proj = nn.Sequential(nn.Linear(hidden, GLA_GATE_RANK, bias=False), nn.Linear(GLA_GATE_RANK, kv_key, bias=True))
        self.o_proj = nn.Linear(o.num_heads * o.head_v_dim, hidden, bias=False)
        self.g_norm = RMSNorm(o.head_v_dim, common.norm_eps)
        if not o.elementwise_affine:  # fla's norm then has no weight: a fixed 1, not in the checkpoint
            fixed_norm(self.g_norm)
        self.act = GATED_FEATURE_MAPS[o.feature_map]
        self.phi = Adjusted(make_feature_map("identity", o.head_k_dim), query_scale=o.head_k_dim**-0.5)
        if o.decay == "fixed":
            # fla's retention kernels: g = log(1 - 2^(-5-h)) for query head h, computed in float32
            gamma = 1 - 2.0 ** (-5.0 - torch.arange(o.num_heads, dtype=torch.float32))
            self.register_buffer("log_gamma", gamma.log(), persistent=False)  # [H]
            inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, o.head_k_dim, 2, dtype=torch.float32) / o.head_k_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)  # [Dk / 2]

    @property
    def state_heads(self) -> int:
        return self.o.num_heads if self.o.decay == "fixed" else self.o.num_kv_heads

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        layout: dict[str, tuple] = {"S": (("batch", self.state_heads, o.head_k_dim, o.head_v_dim), "float32", 0.0)}
        if o.decay == "fixed":
            layout["pos"] = (("batch",), "int64", 0)
        if o.short_conv:
            for name, conv in (("q", self.q_conv1d), ("k", self.k_conv1d), ("v", self.v_conv1d)):
                layout[f"conv_{name}"] = (("batch", conv.weight.shape[0], o.conv_size), "float32", 0.0)
        return layout

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """"chunk" (the prefill graph, fla's chunked form) or "step" (one token, the decode graph)."""
        check_form(self, form, lengths)
        o = self.o
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H Dk], [B, T, Hkv Dk], [B, T, Hkv Dv]
        new: State = {}
        if o.short_conv:
            q, k, v = conv_qkv(self, q, k, v, state, new, form == "step")
        q = split_heads(q, o.num_heads, o.head_k_dim)  # [B, H, T, Dk]
        k = split_heads(k, o.num_kv_heads, o.head_k_dim, self.groups)  # [B, H, T, Dk]
        v = split_heads(v, o.num_kv_heads, o.head_v_dim, self.groups)  # [B, H, T, Dv]
        if self.act is not None:
            q, k = self.act(q), self.act(k)
        if o.decay == "fixed":
            pos = state["pos"]  # [B]
            positions = pos[:, None] + torch.arange(T, device=x.device)[None, :]  # [B, T]
            q, k = rotate(q, positions, self.inv_freq), rotate(k, positions, self.inv_freq)  # fla: halves, float32 angles
            new["pos"] = pos + T
            g = self.log_gamma[None, :, None].expand(B, o.num_heads, T)  # [B, H, T]
            S0 = state["S"]  # [B, H, Dk, Dv]
        else:
            gk = log_sigmoid(self.gk_proj(x)) / GLA_GATE_NORMALIZER  # [B, T, Hkv Dk]
            if o.clamp_min is not None:
                gk = torch.clamp(gk, min=o.clamp_min)
            g = split_heads(gk, o.num_kv_heads, o.head_k_dim, self.groups)  # [B, H, T, Dk]
            S0 = share_state({"S": state["S"]}, self.groups)["S"]  # [B, H, Dk, Dv]
        common = dict(feature_map=self.phi, initial_state={"S": S0}, normalize=False, g=g)
        if form == "step":
            y, out = recurrent_step(q, k, v, **common)  # [B, H, 1, Dv]
        else:
            y, out = FORMS["chunk"](q, k, v, chunk_size=chunk_size, **common)  # [B, H, T, Dv]
        new["S"] = out["S"] if o.decay == "fixed" else unshare_state(out, self.groups)["S"]  # [B, Hs, Dk, Dv]
        y = self.g_norm(y).transpose(1, 2).reshape(B, T, o.num_heads * o.head_v_dim)  # [B, T, H Dv]
        if o.output_gate:
            y = y * F.silu(self.g_proj(x))  # [B, T, H Dv]
        return self.o_proj(y), {name: new[name] for name in self.state_layout()}  # [B, T, hidden]


__all__ = ["FlaGatedAttention", "FlaShortConv", "GATED_FEATURE_MAPS", "GatedOptions", "log_sigmoid"]
