"""RMSNorms as the families compute them: plain, zero-centred (an offset from 1), or without a learned weight."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt, not x * rsqrt: ONNX Runtime fuses exactly this pattern (Pow, ReduceMean, Add, Sqrt, Div, Mul)
        # into one SimplifiedLayerNormalization node when it loads a graph; the rsqrt form stays 8 nodes
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class UnitOffsetRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as an offset from 1: x / rms(x) * (1 + w) (Qwen3.5's, Gemma's "zero-centred"
    norm; the checkpoint holds w, which starts at 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def fixed_norm(norm: RMSNorm) -> RMSNorm:
    """``norm`` without a learned weight (a fixed 1, not in any checkpoint): an fla norm without elementwise_affine."""
    dim = norm.weight.shape[0]
    del norm.weight
    norm.register_buffer("weight", torch.ones(dim), persistent=False)
    return norm


__all__ = ["RMSNorm", "UnitOffsetRMSNorm", "fixed_norm"]
