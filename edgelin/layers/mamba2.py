"""Mamba2's selective state-space layer (SSD) as the skeleton's mixer kind "mamba2", on edgelin's linear-attention
forms with a per-head decay: the state-space recurrence is linear attention with q = C, k = B, v = dt x and the
log-decay g = dt A.

Per layer, as transformers' ``Mamba2Mixer`` computes it (torch path):

    z, xBC, dt = in_proj(h) split as [I, I + 2 G N, H]               (I = expand * hidden = H * P)
    xBC = silu(conv(xBC))                                              (a depthwise causal conv of K taps, bias)
    x, B, C = xBC split as [I, G N, G N];  x [H, P], B and C [G, N]; head h reads group h // (H / G)
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)          (per head)
    S_t = exp(dt_t A) S_{t-1} + dt_t B_t x_t^T      (S [N, P] per head);   y_t = S_t^T C_t + D x_t
    y = RMSNorm over each group of I / G features of (y * silu(z)), times w;  out = out_proj(y)

Falcon-H1's options: the norm before the gate (``norm_before_gate``: y = RMSNorm(y) w * silu(z)), no norm at all
(``rms_norm`` False: y = y * silu(z)), and a bias on out_proj that is not in_proj's (``out_bias``).

State per layer: "S" [B, H, N, P] (the ops' key-major layout; transformers' cache holds [B, H, P, N]) and "conv"
[B, I + 2 G N, K], the last K raw inputs of the conv (transformers' cache layout).

transformers clamps dt by ``time_step_limit`` in its prefill path but not in its one-token step; edgelin clamps in
both (with the default (0, inf) the two agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.ops import fused
from edgelin.layers.feature_maps import make_feature_map
from edgelin.ops import FORMS, recurrent_step, state_layout
from edgelin.layers.short_conv import WindowConv
from edgelin.layers import check_form, register_mixer
from edgelin.state import State


@dataclass(frozen=True)
class Mamba2Options:
    d_model: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    n_groups: int  # G (B and C per group)
    conv_kernel: int  # K
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj biases
    norm_eps: float = 1e-5
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = math.inf
    rms_norm: bool = True  # the gated RMSNorm; False: y * silu(z) and no norm (Falcon-H1's mamba_rms_norm false)
    norm_before_gate: bool = False  # RMSNorm(y) * silu(z) instead of RMSNorm(y * silu(z)) (Falcon-H1's mamba_norm_before_gate)
    out_bias: bool | None = None  # out_proj's bias; None: as ``bias`` (Falcon-H1's projectors_bias)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size


@register_mixer("mamba2")
class Mamba2Mixer(nn.Module):
    """Mamba2's SSD layer (module docstring). Forms: "chunk" (the prefill graph), "step" (the decode graph) and the
    ops' "naive" reference."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False
    bounded_state = True  # S decays (dt A < 0); the conv window holds activations

    def __init__(self, o: Mamba2Options) -> None:
        super().__init__()
        if o.num_heads % o.n_groups:
            raise ValueError(f"n_groups ({o.n_groups}) must divide num_heads ({o.num_heads})")
        self.o = o
        self.in_proj = nn.Linear(o.d_model, o.inner + o.conv_dim + o.num_heads, bias=o.bias)
        self.conv1d = WindowConv(o.conv_dim, o.conv_kernel, silu=True, bias=o.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(o.num_heads))
        self.A_log = nn.Parameter(torch.zeros(o.num_heads))
        self.D = nn.Parameter(torch.ones(o.num_heads))
        if o.rms_norm:
            self.gate_norm_weight = nn.Parameter(torch.ones(o.inner))
        self.out_proj = nn.Linear(o.inner, o.d_model, bias=o.bias if o.out_bias is None else o.out_bias)
        self.phi = make_feature_map("identity", o.state_size)

    def state_layout(self) -> dict[str, tuple]:
        layout = state_layout(self.phi, n_heads=self.o.num_heads, value_dim=self.o.head_dim, normalize=False)
        layout["conv"] = (("batch", self.o.conv_dim, self.o.conv_kernel), "float32", 0.0)
        return layout

    def _groups(self, t: torch.Tensor) -> torch.Tensor:
        """[B, T, G N] -> [B, H, T, N]: head h reads group h // (H / G)."""
        o = self.o
        B, T, _ = t.shape
        t = t.view(B, T, o.n_groups, 1, o.state_size).expand(B, T, o.n_groups, o.num_heads // o.n_groups, o.state_size)
        return t.reshape(B, T, o.num_heads, o.state_size).transpose(1, 2)  # [B, H, T, N]

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        check_form(self, form, lengths)
        o = self.o
        B, T, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([o.inner, o.conv_dim, o.num_heads], dim=-1)
        xbc, window = self.conv1d(xbc, state["conv"], form == "step")  # [B, T, conv_dim], [B, conv_dim, K]
        xs, b, c = xbc.split([o.inner, o.n_groups * o.state_size, o.n_groups * o.state_size], dim=-1)
        dt = fused.softplus(dt + self.dt_bias)  # [B, T, H]
        if o.dt_min > 0.0 or math.isfinite(o.dt_max):
            dt = dt.clamp(min=o.dt_min, max=o.dt_max)
        g = (dt * -self.A_log.exp()).transpose(1, 2)  # [B, H, T]: the log-decay, <= 0
        heads = xs.view(B, T, o.num_heads, o.head_dim).transpose(1, 2)  # [B, H, T, P]
        v = heads * dt.transpose(1, 2)[..., None]  # [B, H, T, P]
        run = dict(feature_map=self.phi, initial_state={"S": state["S"]}, normalize=False, g=g)
        if form == "step":
            y, out = recurrent_step(self._groups(c), self._groups(b), v, **run)  # [B, H, 1, P]
        else:
            y, out = FORMS[form](self._groups(c), self._groups(b), v, chunk_size=chunk_size, **run)  # [B, H, T, P]
        y = y + self.D[:, None, None] * heads  # [B, H, T, P]
        if o.rms_norm and o.norm_before_gate:
            y = y.transpose(1, 2).reshape(B, T, o.inner)  # [B, T, I]: normed, then gated
        else:
            y = y.transpose(1, 2).reshape(B, T, o.inner) * F.silu(z)  # [B, T, I]: gated before the norm (or without one)
        if o.rms_norm:
            grouped = y.view(B, T, o.n_groups, o.inner // o.n_groups)
            grouped = grouped / torch.sqrt(grouped.pow(2).mean(-1, keepdim=True) + o.norm_eps)
            y = grouped.reshape(B, T, o.inner) * self.gate_norm_weight
            if o.norm_before_gate:
                y = y * F.silu(z)
        return self.out_proj(y), {"S": out["S"], "conv": window}


__all__ = ["Mamba2Mixer", "Mamba2Options"]
