"""Short causal convolutions: the window convolution the imported layers share, and LFM2's gated short conv as
the skeleton's mixer kind "short_conv".

``WindowConv``: a depthwise causal convolution over the last W inputs, optionally then SiLU. Its window is the
cache layout fla and transformers keep, the last W inputs [B, D, W], oldest first (zeros before the start); the
oldest column is dropped before use, so y_t = b + sum_i w_i x_{t-W+1+i}.

``GatedShortConv`` (LFM2's conv layer, transformers' ``Lfm2ShortConv``):

    B, C, x = in_proj(h) split in three (rows [0:D], [D:2D], [2D:3D]);  u = B * x
    y = out_proj(C * conv(u))                 (conv: WindowConv over u, no activation)

State per layer: "conv" [B, D, W], the last W values of u (transformers' cache). The step form is the same code
at T = 1; the naive form a per-token loop written from the formula (the slow reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.ops import fused
from edgelin.layers import check_form, register_mixer
from edgelin.state import State


class WindowConv(nn.Module):
    """A depthwise causal convolution over a carried window (module docstring); ``silu``: SiLU after it."""

    def __init__(self, dim: int, size: int, *, silu: bool = True, bias: bool = False) -> None:
        super().__init__()
        self.size, self.silu = size, silu
        self.weight = nn.Parameter(torch.zeros(dim, 1, size))  # [D, 1, W], fla's and transformers' name and shape
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor, window: torch.Tensor, step: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, D], window [B, D, W] -> y [B, T, D], the new window [B, D, W].

        ``step`` (one token: the decode graph) computes the same sum as a weighted sum over the window (Mul +
        ReduceSum) with no Conv and no Transpose: in ONNX Runtime a depthwise Conv of one output position cost ~45 us
        per layer and token on this project's CPU, the largest share of a Mamba2 decode step (19 % of its kernel
        time, ORT's profiler, hidden 256)."""
        if fused.active():  # the fused lowering: one CausalConvWithState node
            return self._fused(x, window, step)
        if step:
            B, _, D = x.shape
            full = torch.cat([window[:, :, 1:], x.reshape(B, D, 1)], dim=2)  # [B, D, W]: T = 1, so no Transpose
            y = (full * self.weight[:, 0, :]).sum(-1, keepdim=True)  # [B, D, 1]
            if self.bias is not None:
                y = y + self.bias[:, None]
            if self.silu:
                y = F.silu(y)
            return y.reshape(B, 1, D), full  # [B, 1, D], [B, D, W]
        full = torch.cat([window, x.transpose(1, 2)], dim=2)  # [B, D, W + T]
        y = F.conv1d(full[:, :, 1:], self.weight, self.bias, groups=self.weight.shape[0])  # [B, D, T]
        if self.silu:
            y = F.silu(y)
        return y.transpose(1, 2), full[:, :, -self.size :]  # [B, T, D], [B, D, W]

    def _fused(self, x: torch.Tensor, window: torch.Tensor, step: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The same through ``fused.causal_conv``: the node carries the last K - 1 inputs of a kernel of K taps, so
        the window of W is carried whole as the state of a kernel of W + 1 taps whose first (the oldest input,
        dropped here) is zero; the node's present state is then exactly the new window. Channels first, as the
        window is; at T = 1 the layout change is a Reshape, not a Transpose."""
        B, T, D = x.shape
        weight = F.pad(self.weight, (1, 0))  # [D, 1, W + 1]
        xc = x.reshape(B, D, 1) if step else x.transpose(1, 2)  # [B, D, T]
        y, window = fused.causal_conv(xc, weight, self.bias, window, channels_last=False, silu=self.silu)  # [B, D, T], [B, D, W]
        return (y.reshape(B, 1, D) if step else y.transpose(1, 2)), window


def conv_qkv(layer: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: State, new: State, step: bool = False):
    """fla's three short convs of a layer (``q_conv1d``, ``k_conv1d``, ``v_conv1d``) on q, k, v [B, T, D], their
    windows read from ``state`` and written to ``new`` as "conv_q", "conv_k", "conv_v"; ``step``: one token."""
    q, new["conv_q"] = layer.q_conv1d(q, state["conv_q"], step)
    k, new["conv_k"] = layer.k_conv1d(k, state["conv_k"], step)
    v, new["conv_v"] = layer.v_conv1d(v, state["conv_v"], step)
    return q, k, v


@register_mixer("short_conv")
class GatedShortConv(nn.Module):
    """LFM2's gated short convolution (module docstring)."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False
    bounded_state = True  # a window of activations, not a running sum

    def __init__(self, d_model: int, size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.d_model, self.size = d_model, size
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.conv = WindowConv(d_model, size, silu=False, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def state_layout(self) -> dict[str, tuple]:
        return {"conv": (("batch", self.d_model, self.size), "float32", 0.0)}

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        check_form(self, form, lengths)
        b, c, v = self.in_proj(x).chunk(3, dim=-1)  # [B, T, D] each
        u = b * v  # [B, T, D]
        if form == "naive":
            y, window = self._naive(u, state["conv"])
        else:
            y, window = self.conv(u, state["conv"], form == "step")  # [B, T, D], [B, D, W]
        return self.out_proj(c * y), {"conv": window}

    def _naive(self, u: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y_t = bias + sum_i w_i u_{t-W+1+i}, one token at a time, the window shifted by hand."""
        w = self.conv.weight[:, 0, :]  # [D, W]
        outs = []
        for t in range(u.shape[1]):
            window = torch.cat([window[:, :, 1:], u[:, t, :, None]], dim=2)  # [B, D, W]: the last W inputs
            y = (window * w).sum(-1)  # [B, D]
            outs.append(y if self.conv.bias is None else y + self.conv.bias)
        return torch.stack(outs, dim=1), window  # [B, T, D], [B, D, W]


__all__ = ["GatedShortConv", "WindowConv", "conv_qkv"]
