"""Mamba-1's selective state-space layer as the skeleton's mixer kind "mamba" (transformers' ``MambaMixer``, and
the same layer with RMSNorms on dt, B and C: ``FalconMambaMixer``'s without a weight, ``JambaMambaMixer``'s with one).

Per layer, as transformers computes it on its PyTorch path (I = d_inner, N = state size, R = dt rank):

    x, z = in_proj(h) split in two halves [I, I]
    x = silu(conv(x))                                  (a depthwise causal conv of K taps, optional bias)
    dt, B, C = x_proj(x) split as [R, N, N]            (no bias)
    dt, B, C = rms(dt), rms(B), rms(C)                 (Falcon-Mamba: no weight; Jamba: learned weights; Mamba: none)
    dt = softplus(dt_proj(dt));  A = -exp(A_log)       (dt [I] per token, A [I, N])
    h_t = exp(dt_t A) h_{t-1} + (dt_t B_t) x_t         (h [I, N]: a decay per channel and per state element)
    y_t = h_t C_t + D x_t;  out = out_proj(y * silu(z))

The recurrence runs on edgelin.ops.selective_scan (chunked prefill, one-token step, the float64-ready naive loop).
State per layer: "S" [B, I, N] (transformers' recurrent state, the same layout) and "conv" [B, I, K], the last K
inputs of the conv (transformers' conv state). Under ``--ops fused`` the recurrence is one ONNX Runtime
``LinearAttention`` node (update rule "gated", I heads of key width N and value width 1, q = C and k = B shared by
every head, v = dt x, the per-key log-decay dt A, scale 1: exactly this recurrence) and the conv one
``CausalConvWithState`` node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.norms import RMSNorm, fixed_norm
from edgelin.layers.short_conv import WindowConv
from edgelin.ops import fused
from edgelin.ops.selective_scan import SCAN_FORMS
from edgelin.state import State

BCDT_NORMS = (None, "fixed", "learned")  # no norm on dt, B, C (Mamba); without a weight (Falcon-Mamba); with one (Jamba)


@dataclass(frozen=True)
class MambaOptions:
    d_model: int
    inner: int  # I = expand * d_model
    state_size: int  # N
    dt_rank: int  # R
    conv_kernel: int  # K
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj biases
    bcdt_norm: str | None = None  # a BCDT_NORMS value
    bcdt_eps: float = 1e-6


@register_mixer("mamba")
class MambaMixer(nn.Module):
    """Mamba-1's selective scan layer (module docstring). Forms: "chunk" (the prefill graph), "step" (the decode
    graph) and "naive" (the per-token reference, conv included)."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False
    bounded_state = True  # S decays (dt A < 0); the conv window holds activations
    # Linears an int4 export keeps in 8-bit blocks (edgelin.quantref.eight_bit_linears): out_proj reads the scan's
    # gated output un-normalised, whose few outlier channels (|x| up to ~1e4 against an RMS of ~1e2 on a Mamba trained
    # for minutes) turn the 4-bit error of their weight rows into most of int4's held-out loss (docs/importers.md)
    eight_bit_linears = ("out_proj",)

    def __init__(self, o: MambaOptions) -> None:
        super().__init__()
        if o.bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"bcdt_norm must be one of {BCDT_NORMS}, got {o.bcdt_norm!r}")
        self.o = o
        self.in_proj = nn.Linear(o.d_model, 2 * o.inner, bias=o.bias)
        self.conv1d = WindowConv(o.inner, o.conv_kernel, silu=True, bias=o.conv_bias)
        self.x_proj = nn.Linear(o.inner, o.dt_rank + 2 * o.state_size, bias=False)
        self.dt_proj = nn.Linear(o.dt_rank, o.inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(o.inner, o.state_size))
        self.D = nn.Parameter(torch.ones(o.inner))
        self.out_proj = nn.Linear(o.inner, o.d_model, bias=o.bias)
        if o.bcdt_norm is not None:
            norms = [RMSNorm(width, o.bcdt_eps) for width in (o.dt_rank, o.state_size, o.state_size)]
            if o.bcdt_norm == "fixed":
                norms = [fixed_norm(norm) for norm in norms]
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = norms

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        return {"S": (("batch", o.inner, o.state_size), "float32", 0.0),
                "conv": (("batch", o.inner, o.conv_kernel), "float32", 0.0)}

    def _conv(self, x: torch.Tensor, window: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(conv(x)) [B, T, I] and the new window; the naive form steps the window token by token."""
        if form != "naive":
            return self.conv1d(x, window, form == "step")
        outs = []
        for t in range(x.shape[1]):
            y, window = self.conv1d(x[:, t : t + 1], window, True)
            outs.append(y)
        return torch.cat(outs, dim=1), window

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        check_form(self, form, lengths)
        o = self.o
        Bt, T, _ = x.shape
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # [B, T, I] each
        xs, window = self._conv(xs, state["conv"], form)  # [B, T, I], [B, I, K]
        dt, b, c = self.x_proj(xs).split([o.dt_rank, o.state_size, o.state_size], dim=-1)  # [B, T, R], [B, T, N] x 2
        if o.bcdt_norm is not None:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = fused.softplus(self.dt_proj(dt))  # [B, T, I]
        A = -torch.exp(self.A_log)  # [I, N]
        if fused.active() and form != "naive":
            y, S = self._fused(xs, dt, A, b, c, state["S"])
        elif form == "chunk":
            y, S = SCAN_FORMS["chunk"](xs, dt, A, b, c, state["S"], chunk_size or 64)
        else:
            y, S = SCAN_FORMS[form](xs, dt, A, b, c, state["S"])  # [B, T, I], [B, I, N]
        y = (y + xs * self.D) * F.silu(z)  # [B, T, I]
        return self.out_proj(y), {"S": S, "conv": window}

    def _fused(self, xs, dt, A, b, c, S) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence as one LinearAttention node: I heads, q = C and k = B repeated per head [B, T, I N],
        v = dt x [B, T, I], the log-decay dt A [B, T, I N], the state [B, I, N, 1]."""
        Bt, T, inner = xs.shape
        N = A.shape[1]
        q = c[:, :, None, :].expand(Bt, T, inner, N).reshape(Bt, T, inner * N)
        k = b[:, :, None, :].expand(Bt, T, inner, N).reshape(Bt, T, inner * N)
        decay = (dt[..., None] * A).reshape(Bt, T, inner * N)
        y, S = fused.linear_attention_op(q, k, dt * xs, S.reshape(Bt, inner, N, 1), decay, None, "gated", inner, 1.0)
        return y, S.reshape(Bt, inner, N)  # [B, T, I], [B, I, N]


__all__ = ["BCDT_NORMS", "MambaMixer", "MambaOptions"]
