"""Kernel feature maps phi for linear attention: sim(q, k) = phi(q)^T phi(k).

A registry maps a name to a ``FeatureMap`` class. Each map knows its output width F and whether it
needs the absolute position of each token (cosFormer), which the attention state then carries.

Every map takes x [B, H, T, D] and returns phi(x) [B, H, T, F].
"""

from __future__ import annotations

import math
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.errors import ConfigError

_REGISTRY: dict[str, type["FeatureMap"]] = {}


def register(name: str) -> Callable[[type["FeatureMap"]], type["FeatureMap"]]:
    def wrap(cls: type[FeatureMap]) -> type[FeatureMap]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_feature_map(name: str, head_dim: int, *, n_features: int = 0, seed: int = 0, horizon: int = 16384) -> "FeatureMap":
    """Build the feature map called ``name``; unknown names raise a ValueError listing the valid ones."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown feature map {name!r}; valid feature maps: {', '.join(_REGISTRY)}") from None
    return cls(head_dim, n_features=n_features, seed=seed, horizon=horizon)


class FeatureMap(nn.Module):
    name: ClassVar[str] = ""
    needs_position: ClassVar[bool] = False  # True: forward() needs positions [B, T] (int64)
    signed: ClassVar[bool] = False  # True: phi can be negative, so phi(q)^T z can be near zero

    def __init__(self, head_dim: int, **_: object) -> None:
        super().__init__()
        self.head_dim = head_dim

    @property
    def out_dim(self) -> int:
        return self.head_dim

    def forward(self, x: torch.Tensor, *, is_query: bool, positions: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


@register("identity")
class Identity(FeatureMap):
    """phi(x) = x. Signed: pair it with normalisation="none" (the denominator can cross zero)."""

    signed = True

    def forward(self, x, *, is_query, positions=None):
        return x


@register("elu+1")
class EluPlusOne(FeatureMap):
    """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al., 2020). The +1 keeps every feature positive."""

    def forward(self, x, *, is_query, positions=None):
        return F.elu(x) + 1.0


@register("relu")
class Relu(FeatureMap):
    """phi(x) = relu(x) >= 0. A query orthogonal to every key gets phi(q)^T z = 0: the eps handles it."""

    def forward(self, x, *, is_query, positions=None):
        return F.relu(x)


@register("softplus")
class Softplus(FeatureMap):
    """phi(x) = softplus(x) = log(1 + e^x) > 0. No shift needed: it is positive everywhere."""

    def forward(self, x, *, is_query, positions=None):
        return F.softplus(x)


@register("performer")
class Performer(FeatureMap):
    """FAVOR+ positive orthogonal random features (Choromanski et al., 2021).

    With x' = x / D^(1/4) and rows w_i of a frozen, seeded projection W [m, D]:
        phi(x)_i = exp(w_i^T x' - |x'|^2 / 2) / sqrt(m),   E[phi(q)^T phi(k)] = exp(q^T k / sqrt(D)).

    Stabiliser (no overflow for any |q|, |k|):
    - keys: w^T x - |x|^2/2 <= |w||x| - |x|^2/2 <= |w|^2/2 for every x, so a key feature can never exceed
      exp(max_i |w_i|^2 / 2). We subtract the fixed constant c = max(0, max_i |w_i|^2/2 - 30), so every key
      feature is <= e^30 whatever the input. Large-norm keys go towards 0 (underflow), never to inf.
    - queries: we subtract the per-query maximum over features of the exponent (so the largest query
      feature is exactly 1). That is a positive scalar per query: it cancels in phi(q)^T S / phi(q)^T z
      (and under the per-head RMSNorm of normalisation="none"), up to the tiny eps.
    The constant c and the per-query shift change no attention weight; they only move the range.
    """

    def __init__(self, head_dim: int, *, n_features: int = 0, seed: int = 0, **_: object) -> None:
        super().__init__(head_dim)
        m = n_features or head_dim
        self.n_features = m
        w = _orthogonal_gaussian(m, head_dim, seed)  # [m, D], float64
        self.register_buffer("projection", w.to(torch.float32))  # frozen; saved in the checkpoint
        self.key_shift = max(0.0, 0.5 * float((w * w).sum(-1).max()) - 30.0)

    @property
    def out_dim(self) -> int:
        return self.n_features

    def forward(self, x, *, is_query, positions=None):
        x = x * (self.head_dim ** -0.25)
        wx = torch.einsum("bhtd,md->bhtm", x, self.projection.to(x.dtype))  # [B, H, T, m]
        if is_query:
            # -|x|^2/2 is constant over features: the max subtraction removes it anyway
            a = wx - wx.amax(dim=-1, keepdim=True)  # [B, H, T, m], max 0
            return torch.exp(a)
        a = wx - 0.5 * (x * x).sum(-1, keepdim=True) - self.key_shift  # [B, H, T, m], <= 30
        return torch.exp(a) * (self.n_features ** -0.5)


def _orthogonal_gaussian(m: int, d: int, seed: int) -> torch.Tensor:
    """m x d matrix of orthogonal blocks whose rows have chi(d)-distributed norms (like Gaussian rows)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r))[None, :]  # unique QR: a Haar-distributed orthogonal matrix
        blocks.append(q.T)
    w = torch.cat(blocks, dim=0)[:m]  # [m, d], orthonormal rows within each block
    norms = torch.randn(m, d, generator=gen, dtype=torch.float64).norm(dim=-1)  # [m]
    return w * norms[:, None]


@register("cosformer")
class CosFormer(FeatureMap):
    """cosFormer (Qin et al., 2022): relu features re-weighted by cos(pi/2 * (i - j) / M).

    cos(a_i - a_j) = cos a_i cos a_j + sin a_i sin a_j with a_i = pi/2 * i / M, so
        phi(x_i) = [relu(x_i) cos a_i, relu(x_i) sin a_i]   (F = 2 D)
    and phi(q_i)^T phi(k_j) = relu(q_i)^T relu(k_j) cos(pi/2 (i - j) / M). The absolute position i is
    carried in the attention state ("pos"), so prefill and decode agree on it. M is a fixed horizon
    (config ``cosformer_horizon``): keys further back than M get weight <= 0, so keep M above the
    longest context you run.
    """

    needs_position = True

    def __init__(self, head_dim: int, *, horizon: int = 16384, **_: object) -> None:
        super().__init__(head_dim)
        self.horizon = horizon

    @property
    def out_dim(self) -> int:
        return 2 * self.head_dim

    def forward(self, x, *, is_query, positions=None):
        if positions is None:
            raise ValueError("cosformer needs the absolute positions of the tokens")
        angle = positions.to(x.dtype) * (math.pi / (2 * self.horizon))  # [B, T]
        angle = angle[:, None, :, None]  # [B, 1, T, 1]
        r = F.relu(x)
        return torch.cat([r * torch.cos(angle), r * torch.sin(angle)], dim=-1)  # [B, H, T, 2D]


__all__ = ["FeatureMap", "available", "make_feature_map", "register"]
