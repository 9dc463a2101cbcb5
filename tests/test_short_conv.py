"""WindowConv, the causal depthwise conv the imported layers share (fla's q/k/v convs, Mamba2's, Qwen3.5's, LFM2's),
and LinearLM's ShortConv: their one-token path (the decode graph: a weighted sum over the window, no Conv node) and
their sequence path from a carried window against a loop written from the formula y_t = b + sum_i w_i x_{t-W+1+i}
in float64, token by token -- in both lowerings (under ``lowering("fused")`` both paths are one CausalConvWithState
node, ``edgelin.ops.fused.causal_conv``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgelin.ops import fused
from edgelin.layers.linear_attention import ShortConv
from edgelin.layers.short_conv import WindowConv

B, D, W = 2, 5, 4


def _conv(silu: bool, bias: bool) -> WindowConv:
    torch.manual_seed(0)
    conv = WindowConv(D, W, silu=silu, bias=bias).double()
    with torch.no_grad():
        conv.weight.normal_()
        if bias:
            conv.bias.normal_()
    return conv


def _loop(conv: WindowConv, x: torch.Tensor, window: torch.Tensor):
    """The formula, one token at a time, the window shifted by hand."""
    outs = []
    for t in range(x.shape[1]):
        window = torch.cat([window[:, :, 1:], x[:, t, :, None]], dim=2)  # [B, D, W]
        y = (window * conv.weight[:, 0, :]).sum(-1) + (0 if conv.bias is None else conv.bias)
        outs.append(F.silu(y) if conv.silu else y)
    return torch.stack(outs, dim=1), window


LOWERINGS = ("portable", "fused")
LENGTHS = (1, W - 1, W, W + 1, 9)


@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_the_step_and_the_sequence_paths_equal_the_formula(silu, bias, lowering, T):
    conv = _conv(silu, bias)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    window = torch.randn(B, D, W, generator=gen, dtype=torch.float64)  # a carried window: not zeros
    ref_y, ref_window = _loop(conv, x, window)
    with torch.no_grad(), fused.lowering(lowering):
        y, new = conv(x, window)
        assert (y - ref_y).abs().max() <= 1e-12 and torch.equal(new, ref_window)
        state = window
        for t in range(x.shape[1]):
            y, state = conv(x[:, t : t + 1], state, step=True)
            assert y.shape == (B, 1, D) and state.shape == (B, D, W)
            assert (y[:, 0] - ref_y[:, t]).abs().max() <= 1e-12, t
        assert torch.equal(state, ref_window)


@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("lowering", LOWERINGS)
def test_linearlms_short_conv_equals_the_formula(lowering, T):
    """ShortConv keeps the last size - 1 inputs [B, size - 1, d] (channels last) and has no bias or activation."""
    conv = ShortConv(D, W).double()
    gen = torch.Generator().manual_seed(10 + T)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(D, 1, W, generator=gen, dtype=torch.float64))
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    past = torch.randn(B, W - 1, D, generator=gen, dtype=torch.float64)
    window, outs = past, []
    for t in range(T):  # the formula, the window shifted by hand
        full = torch.cat([window, x[:, t : t + 1]], dim=1)  # [B, W, D]
        outs.append((full * conv.weight[:, 0, :].t()).sum(1))
        window = full[:, 1:]
    ref_y = torch.stack(outs, dim=1)
    with torch.no_grad(), fused.lowering(lowering):
        y, new = conv(x, past)
        assert (y - ref_y).abs().max() <= 1e-12 and torch.equal(new, window)
        state = past
        for t in range(T):
            y, state = conv(x[:, t : t + 1], state, step=True)
            assert y.shape == (B, 1, D) and state.shape == (B, W - 1, D)
            assert (y[:, 0] - ref_y[:, t]).abs().max() <= 1e-12, t
        assert torch.equal(state, window)
