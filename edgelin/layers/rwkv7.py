"""RWKV-7 (kind "fla/rwkv7"): fla's time mix ``RWKV7Attention`` on the DPLR recurrence (edgelin.ops.dplr), and its
channel mix ``RWKV7FeedForward`` (a block's MLP with a state).

Time mix, per layer, as fla 0.6.0 computes it at inference (``fla/layers/rwkv7.py``; x [B, T, C] the block's normed
input, C = hidden_size, H heads of K = head_dim, V = value_dim / H):

    token shift: x_prev = the previous token's x (the state "shift" [B, C] before the first), d = x_prev - x
    x_c = x + d * x_c  for c in r, w, k, v, a, g (per-channel mixing coefficients)
    r = r_proj x_r, k = k_proj x_k, v = v_proj x_v                     [B, T, C], [B, T, C], [B, T, H V]
    w = -exp(-1/2) * sigmoid(w_lora x_w)   (log-decay in (-0.607, 0); LoRA: up(tanh(down x)) + bias)
    layer 0: v_first = v; other layers: v = v + sigmoid(v_lora x_v) * (v_first - v)   (v_lora: up(down x) + bias)
    a = sigmoid(a_lora x_a)   (in-context learning rate; up(down x) + bias);   g = g_lora x_g (up(sigmoid(down x)))
    kk = per head L2-normalise(k * k_k)   (fla's fuse_norm: kk / sqrt(sum kk^2 + 1e-6); else kk / max(|kk|, 1e-12))
    k = k + k * (a - 1) * k_a
    o = DPLR(q = r, k, v, a = -kk, b = kk * a, w; scale 1)   S_t = diag(e^w) S + b (a^T S) + k v^T, o = S^T r
    o = GroupNorm over each head's V channels (eps = K * norm_eps, weight and bias)
    o = (o + (sum over K of r * k * r_k per head) * v) * g;  y = o_proj o

State: "S" [B, H, K, V] (key-major, edgelin.ops.dplr's layout) and "shift" [B, C] (fla's cache ``conv_state``).
v_first travels in the skeleton's per-call ``carry`` (layer 0 writes it, the others read it), never in a state.

Channel mix (``RWKV7FeedForward``): x_prev, d as above (its own state "shift" [B, C], fla's ``ffn_state``),
y = value(relu(key(x + d * x_k))^2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.ops import State
from edgelin.ops.dplr import DPLR_FORMS

DECAY_SCALE = math.exp(-0.5)  # fla: w = -0.6065306597126334 * sigmoid(.)
L2_EPS_FUSED = 1e-6  # fla's l2_norm (fuse_norm: true): x / sqrt(sum x^2 + eps)
L2_EPS_TORCH = 1e-12  # torch's F.normalize (fuse_norm: false): x / max(|x|, eps)
V_FIRST = "v_first"  # the carry's entry: layer 0's values [B, T, H V]


def token_shift(x: torch.Tensor, last: torch.Tensor, lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, T, C], last [B, C] (the token before x) -> (x_prev - x [B, T, C], the new last token [B, C]): each row's
    last real token under ``lengths`` [B] (its old ``last`` when it has none)."""
    seq = torch.cat([last[:, None, :].to(x.dtype), x], dim=1)  # [B, T + 1, C]
    delta = seq[:, :-1] - x  # [B, T, C]
    if lengths is None:
        return delta, seq[:, -1]
    index = lengths.view(-1, 1, 1).expand(-1, 1, x.shape[-1])  # [B, 1, C]: position lengths[b] of seq
    return delta, seq.gather(1, index)[:, 0]


class LoRA(nn.Module):
    """fla's LoRA: lora.2(act(lora.0(x))), lora.0 without a bias; ``activation`` None, "tanh" or "sigmoid"."""

    def __init__(self, dim: int, out: int, rank: int, activation: str | None, bias: bool = True) -> None:
        super().__init__()
        self.activation = activation
        self.lora = nn.Sequential(nn.Linear(dim, rank, bias=False), nn.Identity(), nn.Linear(rank, out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lora[0](x)
        if self.activation == "tanh":
            h = torch.tanh(h)
        elif self.activation == "sigmoid":
            h = torch.sigmoid(h)
        return self.lora[2](h)


@dataclass(frozen=True)
class RWKV7Options:
    """One layer of fla's RWKV7Attention."""

    hidden_size: int
    num_heads: int
    head_dim: int  # K
    value_dim: int  # H * V
    decay_low_rank_dim: int
    gate_low_rank_dim: int
    a_low_rank_dim: int
    v_low_rank_dim: int
    norm_eps: float
    fuse_norm: bool  # the kk normalisation's eps (L2_EPS_FUSED or L2_EPS_TORCH)


@register_mixer("fla/rwkv7")
class RWKV7TimeMix(nn.Module):
    """fla's RWKV7Attention (module docstring). ``layer``: its index; layer 0 writes v_first, later ones read it.

    Forms: "chunk" (the prefill graph: the DPLR chunked WY form), "step" (one token: the decode graph) and the
    ops' "naive" and "recurrent" references."""

    forms = tuple(DPLR_FORMS)
    accepts_lengths = True
    # the transition diag(e^w) - (kk a) kk^T has its eigenvalues in the unit disc, but it is not a contraction in
    # every norm (a varies per channel): float16 states are not claimed safe
    bounded_state = False
    uses_carry = True

    def __init__(self, o: RWKV7Options, layer: int) -> None:
        super().__init__()
        self.o, self.layer = o, layer
        C, HV = o.hidden_size, o.value_dim
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k = nn.Parameter(torch.zeros(C))
        self.k_a = nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(o.num_heads, o.head_dim))
        self.r_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, HV, bias=False)
        self.o_proj = nn.Linear(HV, C, bias=False)
        self.w_lora = LoRA(C, C, o.decay_low_rank_dim, "tanh")
        if layer != 0:
            self.v_lora = LoRA(C, HV, o.v_low_rank_dim, None)
        self.a_lora = LoRA(C, C, o.a_low_rank_dim, None)
        self.g_lora = LoRA(C, HV, o.gate_low_rank_dim, "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(o.num_heads, HV, eps=o.head_dim * o.norm_eps)  # only its weight and bias are used

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        return {
            "S": (("batch", o.num_heads, o.head_dim, o.value_dim // o.num_heads), "float32", 0.0),
            "shift": (("batch", o.hidden_size), "float32", 0.0),
        }

    def _heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.o.num_heads, dim)  # [B, T, H, dim]

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None, carry: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, State]:
        """x [B, T, C], state {"S", "shift"} -> (y [B, T, C], the new state); ``carry`` holds v_first."""
        check_form(self, form, lengths)
        o = self.o
        B, T, C = x.shape
        H, K, V = o.num_heads, o.head_dim, o.value_dim // o.num_heads
        delta, shift = token_shift(x, state["shift"], lengths)  # [B, T, C], [B, C]
        r = self.r_proj(x + delta * self.x_r)  # [B, T, C]
        w = -DECAY_SCALE * torch.sigmoid(self.w_lora(x + delta * self.x_w))  # [B, T, C]
        k = self.k_proj(x + delta * self.x_k)  # [B, T, C]
        xv = x + delta * self.x_v
        v = self.v_proj(xv)  # [B, T, H V]
        if carry is None:
            raise ValueError("RWKV-7 layers need the skeleton's carry (v_first from layer 0)")
        if self.layer == 0:
            carry[V_FIRST] = v
        else:
            if V_FIRST not in carry:
                raise ValueError(f"RWKV-7 layer {self.layer} runs before a layer 0 has set v_first")
            v = v + torch.sigmoid(self.v_lora(xv)) * (carry[V_FIRST] - v)  # torch.lerp(v, v_first, weight)
        a = torch.sigmoid(self.a_lora(x + delta * self.x_a))  # [B, T, C]
        g = self.g_lora(x + delta * self.x_g)  # [B, T, H V]
        kk = self._heads(k * self.k_k, K)  # [B, T, H, K]
        if o.fuse_norm:
            kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True) + L2_EPS_FUSED)
        else:
            kk = kk / torch.sqrt((kk * kk).sum(-1, keepdim=True)).clamp(min=L2_EPS_TORCH)
        k = k + k * (a - 1.0) * self.k_a  # [B, T, C]
        r, w, k, a = (self._heads(t, K) for t in (r, w, k, a))  # [B, T, H, K]
        v = self._heads(v, V)  # [B, T, H, V]
        heads = lambda t: t.transpose(1, 2)  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
        y, out = DPLR_FORMS[form](
            heads(r), heads(k), heads(v), heads(-kk), heads(kk * a), heads(w), initial_state={"S": state["S"]},
            lengths=lengths, **({"chunk_size": chunk_size} if chunk_size else {}),
        )  # [B, H, T, V]
        y = y.transpose(1, 2)  # [B, T, H, V]
        mean = y.mean(-1, keepdim=True)
        centred = y - mean
        y = centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + self.g_norm.eps)  # [B, T, H, V]
        y = y * self.g_norm.weight.view(H, V) + self.g_norm.bias.view(H, V)
        y = y + (r * k * self.r_k).sum(-1, keepdim=True) * v  # [B, T, H, V]
        y = y.reshape(B, T, H * V) * g
        return self.o_proj(y), {"S": out["S"], "shift": shift}


class RWKV7ChannelMix(nn.Module):
    """fla's RWKV7FeedForward, a block's MLP with a state (edgelin.skeleton): value(relu(key(x + d * x_k))^2),
    d = x_prev - x. ``cfg``: d_model and mlp_hidden. State: "shift" [B, d_model], the previous token's input."""

    forms = None  # any form: the token shift is the same code for one token and for many
    accepts_lengths = True
    bounded_state = True  # a copy of a normed input

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.x_k = nn.Parameter(torch.zeros(cfg.d_model))
        self.key = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.value = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def state_layout(self) -> dict[str, tuple]:
        return {"shift": (("batch", self.x_k.shape[0]), "float32", 0.0)}

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        """x [B, T, C], {"shift": [B, C]} -> (y [B, T, C], {"shift": [B, C]})."""
        delta, shift = token_shift(x, state["shift"], lengths)
        return self.value(torch.relu(self.key(x + delta * self.x_k)).square()), {"shift": shift}


__all__ = ["DECAY_SCALE", "LoRA", "RWKV7ChannelMix", "RWKV7Options", "RWKV7TimeMix", "token_shift"]
