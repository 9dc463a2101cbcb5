"""The delta rule with fla's conventions (kind "fla/delta"): fla's DeltaNet, GatedDeltaNet, KimiDeltaAttention and
GatedDeltaProduct layers, also Qwen3.5's and Qwen3-Next's Gated DeltaNet, on the delta rule's forms (edgelin.ops.delta).

Per layer, as fla 0.6.0 computes it at inference (``fla/layers/delta_net.py``, ``fla/layers/gated_deltanet.py``):

    q, k, v = q_proj x, k_proj x, v_proj x
    short convs (fla's ShortConvolution, window W = conv_size) on each, SiLU after them; DeltaNet with a
        qk_activation other than silu runs its q/k convs without an activation. No convs: SiLU on q, k (DeltaNet:
        only with qk_activation silu) and on v.
    heads: q, k [B, H, T, K]; v [B, HV, T, V]; value head j reads query/key head j // (HV / H) (GatedDeltaNet's
        grouped value heads, ``num_v_heads``; DeltaNet has HV = H)
    DeltaNet's qk_activation relu / elu (elu + 1) / identity; qk_norm "l2" (in the op: x / sqrt(sum x^2 + 1e-6))
        or "sum" (x / max(sum |x|, 1e-6))
    beta = sigmoid(b_proj x) [HV per token] (DeltaNet without use_beta: 1), times 2 with allow_neg_eigval
    g = -exp(A_log) * softplus(a_proj x + dt_bias) (GatedDeltaNet only; softplus as fla's: x above 20)
    o = the delta rule with scale K^-0.5, then per value head RMSNorm(o) * w, times act(g_proj x) with use_gate
        (act: swish, or GatedDeltaNet's output_gate_activation sigmoid), then o_proj.

Kimi Delta Attention (``fla/layers/kda.py``; ``channel_decay``, ``gate_rank``, ``decay_lower_bound``): the decay per
value head and key channel, g [B, HV, T, K] = -exp(A_log)[h] * softplus(f + dt_bias) with f = f_proj x (Linear(hidden
-> head_v_dim) then Linear(-> HV K)) and dt_bias [HV K], or with lower_bound b: b * sigmoid(exp(A_log)[h] (f + dt_bias));
the delta rule decays S's rows first, then writes; the output gate sigmoid(g_proj x) with g_proj Linear(hidden ->
head_v_dim) then Linear(-> HV V, with bias); q/k/v convs with SiLU (no convs: SiLU on q, k, v); beta and the L2 norm on.

Gated DeltaProduct (``fla/layers/gated_deltaproduct.py``; ``householder`` n): k_proj, v_proj, b_proj give n keys,
values and betas per token, laid out [n, heads, width] ('... t (n h d) -> ... (t n) h d'), their convs over the whole
width; per token the gate (use_forget_gate), then the n delta steps, then the read-out (edgelin.ops.delta's product).

State per layer: "S" [B, HV, K, V] (key-major; fla's GatedDeltaNet and KDA cache it value-major, [B, HV, V, K]; its
DeltaNet and GatedDeltaProduct key-major), with convs "conv_q", "conv_k" [B, n H K, W] and "conv_v" [B, n HV V, W]
(fla's cache layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.heads import split_heads
from edgelin.layers.norms import RMSNorm
from edgelin.layers.short_conv import WindowConv, conv_qkv
from edgelin.ops import DELTA_FORMS, State, fused
from edgelin.ops.delta import DELTA_PRODUCT_FORMS
from edgelin.protocol import DEFAULT_CHUNK


QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")  # DeltaNet's qk_activation (fla's elu is elu + 1)


QK_NORMS = ("l2", "sum")


GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")  # GatedDeltaNet's output_gate_activation (swish = silu)


SUM_NORM_EPS = 1e-6  # fla's sum_norm: F.normalize(x, p=1, eps=1e-6)


@dataclass(frozen=True)
class DeltaOptions:
    """One layer of fla's DeltaNet (``gated=False``) or GatedDeltaNet (``gated=True``)."""

    gated: bool  # the decay g and its parameters a_proj, A_log, dt_bias
    num_heads: int  # query/key heads H
    num_v_heads: int  # value heads HV (a multiple of H): the state's heads
    head_k_dim: int
    head_v_dim: int
    short_conv: bool
    conv_size: int
    qk_activation: str  # a QK_ACTIVATIONS name
    qk_norm: str  # "l2" or "sum"
    use_beta: bool
    allow_neg_eigval: bool  # beta in [0, 2]
    output_gate: bool  # g_proj
    gate_activation: str  # "swish" or "sigmoid"
    # q, k, v from one projection and one conv over their concatenation [q | k | v] (transformers' Qwen3.5 layout:
    # in_proj_qkv, conv1d; the conv window one state "conv"), not three
    packed_qkv: bool = False
    # Kimi Delta Attention: the decay per key channel, g [B, HV, T, K], from the bottleneck f_proj (hidden -> gate_rank
    # -> HV K) with dt_bias per channel [HV K] and A_log per value head (``gated`` must be True)
    channel_decay: bool = False
    # KDA's f_proj and g_proj are two-layer bottlenecks through this width (g_proj's second layer has a bias); 0: one
    # full-rank layer each (a_proj, g_proj)
    gate_rank: int = 0
    # KDA's lower_bound: g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) instead of -exp(A_log) softplus(f + dt_bias)
    decay_lower_bound: float | None = None
    # Gated DeltaProduct's num_householder n: n keys, values and betas per token (k_proj, v_proj, b_proj and their
    # convs n times wider, laid out [n, heads, width]), n delta steps per token after its gate (edgelin.ops.delta)
    householder: int = 1


def softplus(x: torch.Tensor) -> torch.Tensor:
    """fla's softplus: x itself above 20, torch's default threshold (one Softplus node under the fused lowering)."""
    return fused.softplus(x)


def bottleneck(width: int, rank: int, out: int, *, bias: bool) -> nn.Module:
    """KDA's low-rank projection: Linear(width -> rank, no bias) then Linear(rank -> out, ``bias``), as fla's
    nn.Sequential (weights "0.weight", "1.weight", "1.bias")."""
    return nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, out, bias=bias))


@register_mixer("fla/delta")
class FlaDeltaAttention(nn.Module):
    """fla's DeltaNet and GatedDeltaNet layers on the delta rule's forms (the module docstring has the math).

    Forms: "chunk" (the prefill graph: the WY form, no loop over tokens), "step" (one token: the decode graph),
    and the ops' "naive" and "recurrent" references."""

    forms = tuple(DELTA_FORMS)
    accepts_lengths = False  # fla's short convs here take no lengths
    # GatedDeltaNet's state decays; DeltaNet's does not (and with allow_neg_eigval it can grow)
    bounded_state = False

    def __init__(self, o: DeltaOptions, common: Any) -> None:  # common: hidden_size, norm_eps (edgelin.layers.LayerSizes, fla's Common)
        super().__init__()
        self.o = o
        self.bounded_state = o.gated and not o.allow_neg_eigval
        self.groups = o.num_v_heads // o.num_heads
        hidden, key, value = common.hidden_size, o.num_heads * o.head_k_dim, o.num_v_heads * o.head_v_dim
        self.widths = (key, key, value)
        if o.channel_decay and not o.gated:
            raise ValueError("a per-channel decay (channel_decay) needs gated=True")
        if o.householder > 1 and (o.packed_qkv or o.channel_decay):
            raise ValueError("several Householder steps per token (householder > 1) take three projections and a per-head decay")
        n = o.householder
        if o.packed_qkv:
            self.qkv_proj = nn.Linear(hidden, 2 * key + value, bias=False)
            if o.short_conv:
                self.qkv_conv1d = WindowConv(2 * key + value, o.conv_size)
        else:
            self.q_proj = nn.Linear(hidden, key, bias=False)
            self.k_proj = nn.Linear(hidden, n * key, bias=False)
            self.v_proj = nn.Linear(hidden, n * value, bias=False)
        if o.use_beta:
            self.b_proj = nn.Linear(hidden, n * o.num_v_heads, bias=False)
        if o.gated:
            decays = o.num_v_heads * (o.head_k_dim if o.channel_decay else 1)  # one decay per value head (and key channel)
            if o.channel_decay:
                self.f_proj = bottleneck(hidden, o.gate_rank, decays, bias=False)
            else:
                self.a_proj = nn.Linear(hidden, decays, bias=False)
            self.A_log = nn.Parameter(torch.zeros(o.num_v_heads))
            self.dt_bias = nn.Parameter(torch.zeros(decays))
        if o.short_conv and not o.packed_qkv:
            qk_silu = o.qk_activation == "silu"
            self.q_conv1d = WindowConv(key, o.conv_size, silu=qk_silu)
            self.k_conv1d = WindowConv(n * key, o.conv_size, silu=qk_silu)
            self.v_conv1d = WindowConv(n * value, o.conv_size)
        if o.output_gate and o.gate_rank:
            self.g_proj = bottleneck(hidden, o.gate_rank, value, bias=True)
        elif o.output_gate:
            self.g_proj = nn.Linear(hidden, value, bias=False)
        self.o_norm = RMSNorm(o.head_v_dim, common.norm_eps)
        self.o_proj = nn.Linear(value, hidden, bias=False)

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        layout: dict[str, tuple] = {"S": (("batch", o.num_v_heads, o.head_k_dim, o.head_v_dim), "float32", 0.0)}
        if o.short_conv and o.packed_qkv:
            layout["conv"] = (("batch", sum(self.widths), o.conv_size), "float32", 0.0)
        elif o.short_conv:
            for name, conv in (("q", self.q_conv1d), ("k", self.k_conv1d), ("v", self.v_conv1d)):
                layout[f"conv_{name}"] = (("batch", conv.weight.shape[0], o.conv_size), "float32", 0.0)
        return layout

    def _qk_activation(self, x: torch.Tensor) -> torch.Tensor:
        act = self.o.qk_activation
        if act == "relu":
            return torch.relu(x)
        if act == "elu":
            return F.elu(x) + 1.0
        return x  # identity; silu ran in (or instead of) the conv

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        check_form(self, form, lengths)
        o = self.o
        B, T, _ = x.shape
        new: State = {}
        if o.packed_qkv:  # one projection, one conv over [q | k | v] (SiLU on all of it)
            qkv = self.qkv_proj(x)  # [B, T, 2 H K + HV V]
            if o.short_conv:
                qkv, new["conv"] = self.qkv_conv1d(qkv, state["conv"], form == "step")
            else:
                qkv = F.silu(qkv)
            q, k, v = qkv.split(self.widths, dim=-1)  # [B, T, H K], [B, T, H K], [B, T, HV V]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B, T, H K], [B, T, H K], [B, T, HV V]
            if o.short_conv:
                q, k, v = conv_qkv(self, q, k, v, state, new, form == "step")
            else:
                if o.qk_activation == "silu":
                    q, k = F.silu(q), F.silu(k)
                v = F.silu(v)
        n = o.householder
        q = split_heads(q, o.num_heads, o.head_k_dim, self.groups)  # [B, HV, T, K]
        if n == 1:
            k = split_heads(k, o.num_heads, o.head_k_dim, self.groups)  # [B, HV, T, K]
            v = split_heads(v, o.num_v_heads, o.head_v_dim)  # [B, HV, T, V]
        else:  # fla's (n h d) layout: step j of head h at j H d + h d
            k = split_heads(k, n * o.num_heads, o.head_k_dim).unflatten(1, (n, o.num_heads))  # [B, n, H, T, K]
            k = k.permute(0, 2, 3, 1, 4)  # [B, H, T, n, K]
            if self.groups > 1:
                k = k[:, :, None].expand(-1, -1, self.groups, -1, -1, -1).flatten(1, 2)  # [B, HV, T, n, K]
            v = split_heads(v, n * o.num_v_heads, o.head_v_dim).unflatten(1, (n, o.num_v_heads))  # [B, n, HV, T, V]
            v = v.permute(0, 2, 3, 1, 4)  # [B, HV, T, n, V]
        q, k = self._qk_activation(q), self._qk_activation(k)
        if o.qk_norm == "sum":
            q = q / q.abs().sum(-1, keepdim=True).clamp(min=SUM_NORM_EPS)
            k = k / k.abs().sum(-1, keepdim=True).clamp(min=SUM_NORM_EPS)
        if o.use_beta:
            beta = torch.sigmoid(self.b_proj(x))  # [B, T, n HV]
            beta = beta.transpose(1, 2) if n == 1 else beta.view(B, T, n, o.num_v_heads).permute(0, 3, 1, 2)  # [B, HV, T(, n)]
        else:
            beta = x.new_ones(B, o.num_v_heads, T)  # [B, HV, T]
        if o.allow_neg_eigval:
            beta = beta * 2.0
        g = None
        if o.channel_decay:  # [B, HV, T, K]
            f = (self.f_proj(x) + self.dt_bias).view(B, T, o.num_v_heads, o.head_k_dim)  # [B, T, HV, K]
            A = self.A_log.exp()[:, None]  # [HV, 1]
            g = -A * softplus(f) if o.decay_lower_bound is None else o.decay_lower_bound * torch.sigmoid(A * f)
            g = g.transpose(1, 2)  # [B, HV, T, K]
        elif o.gated:
            g = (-self.A_log.exp() * softplus(self.a_proj(x) + self.dt_bias)).transpose(1, 2)  # [B, HV, T]
        y, out = (DELTA_FORMS if n == 1 else DELTA_PRODUCT_FORMS)[form](
            q, k, v, beta, g=g, initial_state={"S": state["S"]}, chunk_size=chunk_size or DEFAULT_CHUNK,
            scale=o.head_k_dim**-0.5, qk_l2norm=o.qk_norm == "l2",
        )  # [B, HV, T, V]
        new["S"] = out["S"]
        y = self.o_norm(y.transpose(1, 2))  # [B, T, HV, V]
        if o.output_gate:
            gate = self.g_proj(x).view(B, T, o.num_v_heads, o.head_v_dim)  # [B, T, HV, V]
            y = y * (torch.sigmoid(gate) if o.gate_activation == "sigmoid" else F.silu(gate))
        y = self.o_proj(y.reshape(B, T, o.num_v_heads * o.head_v_dim))  # [B, T, hidden]
        return y, {name: new[name] for name in self.state_layout()}


__all__ = ["DeltaOptions", "FlaDeltaAttention", "GATE_ACTIVATIONS", "QK_ACTIVATIONS", "QK_NORMS", "bottleneck", "softplus"]
