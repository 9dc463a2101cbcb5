"""Griffin's recurrent block with its RG-LRU (RecurrentGemma, Hawk) as the skeleton's mixer kind "rg_lru".

Per layer, as transformers' ``RecurrentGemmaRecurrentBlock`` and ``RecurrentGemmaRglru`` compute it (x [B, T, d]):

    y = gelu_tanh(linear_y(x))                                        [B, T, R]   (R = lru_width)
    v = conv_1d(linear_x(x))                                          a depthwise causal conv of W taps, with bias
    i, r = sigmoid(v_h W_i,h + b_i,h), sigmoid(v_h W_r,h + b_r,h)     block-diagonal: H heads of R / H channels,
                                                                      v_h [R / H] times W_h [R / H, R / H]
    log a_t = -8 r_t softplus(recurrent_param)                        per channel, <= 0
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t v_t)                     at absolute position 0: h_t = i_t v_t
                                                                      (a reset: a_t = 0 and the multiplier 1)
    out = linear_out(h * y)

The recurrence is a diagonal linear scan (edgelin.ops.diagonal): "chunk" (the prefill graph) runs its chunked
parallel form, "step" (the decode graph) one token, "naive" a per-token loop written from the formula (with the
reset as transformers writes it, a_t times (position != 0)). The fast forms apply the reset by starting a row whose
position is 0 from a zero state, which is the same thing: position 0 can only be a call's first token. Under
``--ops fused`` the scan of both graphs is one ONNX Runtime LinearAttention node and the conv one
CausalConvWithState node (WindowConv's).

State per layer: "conv" [B, R, W], the last W inputs of the conv, oldest first (edgelin.layers.short_conv's window:
its oldest column is never used; transformers' ``conv1d_state`` is the last W - 1), "h" [B, R] (transformers'
``recurrent_states``, float32) and "pos" [B] int64, the tokens seen (for the reset at position 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.mlp import gelu_tanh
from edgelin.layers.short_conv import WindowConv
from edgelin.ops import fused
from edgelin.ops.diagonal import DIAGONAL_FORMS, fused_diagonal_scan
from edgelin.state import State

LOG_DECAY_SCALE = -8.0  # transformers' (and Griffin's) constant c in log a = c r softplus(recurrent_param)


@dataclass(frozen=True)
class RGLRUOptions:
    d_model: int
    lru_width: int  # R
    num_heads: int  # H: the gates' diagonal blocks, R / H channels each
    conv_width: int  # W


@register_mixer("rg_lru")
class RGLRUBlock(nn.Module):
    """Griffin's recurrent block (module docstring). Forms: "chunk", "step", "naive"."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False
    bounded_state = True  # h decays (a <= 1, the input scaled by sqrt(1 - a^2)); the conv window holds activations

    def __init__(self, o: RGLRUOptions) -> None:
        super().__init__()
        if o.lru_width % o.num_heads:
            raise ValueError(f"the number of heads ({o.num_heads}) must divide lru_width ({o.lru_width})")
        self.o = o
        R, H, bw = o.lru_width, o.num_heads, o.lru_width // o.num_heads
        self.linear_y = nn.Linear(o.d_model, R)
        self.linear_x = nn.Linear(o.d_model, R)
        self.linear_out = nn.Linear(R, o.d_model)
        self.conv_1d = WindowConv(R, o.conv_width, silu=False, bias=True)  # weight [R, 1, W], bias [R]
        self.recurrent_param = nn.Parameter(torch.zeros(R))
        self.input_gate_weight = nn.Parameter(torch.zeros(H, bw, bw))  # [H, in, out]: v_h @ W_h
        self.input_gate_bias = nn.Parameter(torch.zeros(H, bw))
        self.recurrent_gate_weight = nn.Parameter(torch.zeros(H, bw, bw))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(H, bw))

    def state_layout(self) -> dict[str, tuple]:
        R = self.o.lru_width
        return {
            "conv": (("batch", R, self.o.conv_width), "float32", 0.0),
            "h": (("batch", R), "float32", 0.0),
            "pos": (("batch",), "int64", 0),
        }

    def _gates(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """v [B, T, R] -> the input gate i and the log-decay log a, [B, T, R] each: both gates in one MatMul."""
        B, T, R = v.shape
        H = self.o.num_heads
        weight = torch.cat([self.input_gate_weight, self.recurrent_gate_weight], dim=-1)  # [H, R / H, 2 R / H]
        bias = torch.cat([self.input_gate_bias, self.recurrent_gate_bias], dim=-1)  # [H, 2 R / H]
        gates = torch.sigmoid((v.reshape(B, T, H, 1, R // H) @ weight).reshape(B, T, H, 2 * R // H) + bias)
        i, r = gates.chunk(2, dim=-1)  # [B, T, H, R / H] each
        log_a = LOG_DECAY_SCALE * r.reshape(B, T, R) * fused.softplus(self.recurrent_param)  # [B, T, R]
        return i.reshape(B, T, R), log_a

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        check_form(self, form, lengths)
        B, T, _ = x.shape
        y = gelu_tanh(self.linear_y(x))  # [B, T, R]
        if form == "naive":
            v, window = self._naive_conv(self.linear_x(x), state["conv"])
        else:
            v, window = self.conv_1d(self.linear_x(x), state["conv"], form == "step")  # [B, T, R], [B, R, W]
        i, log_a = self._gates(v)
        pos = state["pos"]  # [B]
        reset = (pos[:, None] + torch.arange(T, device=x.device)[None, :] == 0)[..., None]  # [B, T, 1]: position 0
        multiplier = torch.where(reset, 1.0, torch.sqrt(1.0 - torch.exp(2.0 * log_a)))  # [B, T, R]
        u = v * i * multiplier  # [B, T, R]
        if form == "naive":  # the reset as transformers writes it: a_t = 0 at position 0
            h, last = DIAGONAL_FORMS["naive"](torch.where(reset, float("-inf"), log_a), u, state["h"])
        else:  # the same: a row at position 0 starts from a zero state
            h0 = torch.where((pos == 0)[:, None], 0.0, state["h"])  # [B, R]
            scan = fused_diagonal_scan if fused.active() else DIAGONAL_FORMS[form]  # --ops fused: one LinearAttention node
            h, last = scan(log_a, u, h0, chunk_size=chunk_size or 64)  # [B, T, R], [B, R]
        return self.linear_out(h * y), {"conv": window, "h": last, "pos": pos + T}

    def _naive_conv(self, u: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """v_t = bias + sum_k w_k u_{t-W+1+k}, one token at a time, the window shifted by hand."""
        w = self.conv_1d.weight[:, 0, :]  # [R, W]
        outs = []
        for t in range(u.shape[1]):
            window = torch.cat([window[:, :, 1:], u[:, t, :, None]], dim=2)  # [B, R, W]: the last W inputs
            outs.append((window * w).sum(-1) + self.conv_1d.bias)  # [B, R]
        return torch.stack(outs, dim=1), window  # [B, T, R], [B, R, W]


__all__ = ["LOG_DECAY_SCALE", "RGLRUBlock", "RGLRUOptions"]
