"""RMSNorms as the families compute them: plain, zero-centred (an offset from 1), or without a learned weight; and
LayerNorm (with or without a bias) with the same constructor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.ops import fused


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * w over the last dim. ``norm(x, residual)`` norms x + residual and returns (the norm,
    the sum): one SkipSimplifiedLayerNormalization node under the fused lowering (edgelin.ops.fused), the add and the
    norm otherwise."""

    takes_residual = True  # forward(x, residual) -> (norm of x + residual, x + residual)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            return self._skip(x, residual)
        # x / sqrt, not x * rsqrt: ONNX Runtime fuses exactly this pattern (Pow, ReduceMean, Add, Sqrt, Div, Mul)
        # into one SimplifiedLayerNormalization node when it loads a graph; the rsqrt form stays 8 nodes
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def gain(self) -> torch.Tensor:
        """The factor after the division by the RMS, [dim]."""
        return self.weight

    def _skip(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if fused.active():
            return fused.skip_rms_norm(x, residual, self.gain(), self.eps)
        total = x + residual
        return self(total), total


class UnitOffsetRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from 1: x / rms(x) * (1 + w) (Qwen3.5's, Gemma's "zero-centred"
    norm; the checkpoint holds w, which starts at 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            return self._skip(x, residual)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    def gain(self) -> torch.Tensor:
        return 1.0 + self.weight


class LayerNorm(nn.Module):
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim (biased variance: torch's and fla's
    LayerNorm); the constructor of ``RMSNorm``, so either is a skeleton's ``norm=``. One LayerNormalization node."""

    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BiaslessLayerNorm(LayerNorm):
    """``LayerNorm`` without the bias (fla's ``norm_bias: false``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps, bias=False)


def fixed_norm(norm: RMSNorm) -> RMSNorm:
    """``norm`` without a learned weight (a fixed 1, not in any checkpoint): an fla norm without elementwise_affine."""
    dim = norm.weight.shape[0]
    del norm.weight
    norm.register_buffer("weight", torch.ones(dim), persistent=False)
    return norm


__all__ = ["BiaslessLayerNorm", "LayerNorm", "RMSNorm", "UnitOffsetRMSNorm", "fixed_norm"]
