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

from edgelin.ops import fused
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


def make_feature_map(
    name: str, head_dim: int, *, n_features: int = 0, seed: int = 0, horizon: int = 16384, tie_qk: bool = True
) -> "FeatureMap":
    """Build the feature map called ``name``; unknown names raise a ValueError listing the valid ones.

    ``tie_qk`` matters only for learned maps: False gives queries and keys separate parameters."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown feature map {name!r}; valid feature maps: {', '.join(_REGISTRY)}") from None
    return cls(head_dim, n_features=n_features, seed=seed, horizon=horizon, tie_qk=tie_qk)


class FeatureMap(nn.Module):
    name: ClassVar[str] = ""
    needs_position: ClassVar[bool] = False  # True: forward() needs positions [B, T] (int64)
    signed: ClassVar[bool] = False  # True: phi can be negative (for some input or position), so phi(q)^T z can be near zero

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
        return fused.softplus(x)


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

    Signed: past the horizon cos a_i < 0, so phi(q)^T z can approach zero from either side and the
    denominator needs the sign-taking eps in every form (decode included).
    """

    needs_position = True
    signed = True

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


class LearnedFeatureMap(FeatureMap):
    """A feature map with parameters: ``q`` maps queries and ``k`` keys; with tie_qk, ``q`` maps both.

    Subclasses define ``make_layer()`` (the parameters of one side) and ``apply(layer, x)``.
    """

    def __init__(self, head_dim: int, *, tie_qk: bool = True, **_: object) -> None:
        super().__init__(head_dim)
        self.tie_qk = tie_qk
        self.q = self.make_layer()
        if not tie_qk:  # tied: keys use ``q`` too (one set of parameters, one name in the state dict)
            self.k = self.make_layer()

    def make_layer(self) -> nn.Module:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x, *, is_query, positions=None):
        return self.apply(self.q if is_query or self.tie_qk else self.k, x)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) in x's dtype (a float64 reference run uses the float32 parameters exactly)."""
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, layer.weight.to(x.dtype), bias)


@register("elementwise_product")
class ElementwiseProduct(LearnedFeatureMap):
    """phi(x) = (W1 x + b1) * (W2 x + b2), elementwise (flash-linear-attention's default learned map).

    Signed: the product of two affine maps can take either sign.
    """

    signed = True

    def make_layer(self):
        layer = nn.Module()
        layer.layer1 = nn.Linear(self.head_dim, self.head_dim)
        layer.layer2 = nn.Linear(self.head_dim, self.head_dim)
        return layer

    def apply(self, layer, x):
        return _linear(layer.layer1, x) * _linear(layer.layer2, x)  # [B, H, T, D]


@register("hedgehog")
class Hedgehog(LearnedFeatureMap):
    """Hedgehog (Zhang et al., 2024): phi(x) = softmax([2 (W x + b), -2 (W x + b)]) over the 2 D features.

    W starts as the identity and b at zero. Positive, and each phi(x) sums to 1.
    """

    def make_layer(self):
        layer = nn.Module()
        layer.layer = nn.Linear(self.head_dim, self.head_dim)
        nn.init.eye_(layer.layer.weight)
        nn.init.zeros_(layer.layer.bias)
        return layer

    @property
    def out_dim(self) -> int:
        return 2 * self.head_dim

    def apply(self, layer, x):
        y = 2.0 * _linear(layer.layer, x)  # [B, H, T, D]
        return torch.cat([y, -y], dim=-1).softmax(-1)  # [B, H, T, 2D]


@register("t2r")
class T2R(LearnedFeatureMap):
    """T2R (Kasai et al., 2021): phi(x) = relu(W x), a learned linear map without bias, then relu."""

    def make_layer(self):
        layer = nn.Module()
        layer.layer = nn.Linear(self.head_dim, self.head_dim, bias=False)
        return layer

    def apply(self, layer, x):
        return F.relu(_linear(layer.layer, x))  # [B, H, T, D]


@register("dpfp")
class DPFP(FeatureMap):
    """DPFP (Schlag et al., 2021), parameter-free, nu = 4: with r = [relu(x), relu(-x)] (2 D features),
    phi(x) = concat_j (r * roll(r, j)) for j = 1..nu, F = 2 nu D features, all >= 0.

    roll(r, j) puts r[i - j] at feature i; it is written with slices (no roll op in the graph).
    """

    nu: ClassVar[int] = 4

    @property
    def out_dim(self) -> int:
        return 2 * self.nu * self.head_dim

    def forward(self, x, *, is_query, positions=None):
        r = torch.cat([F.relu(x), F.relu(-x)], dim=-1)  # [B, H, T, 2D]
        rolled = [torch.cat([r[..., -j:], r[..., :-j]], dim=-1) for j in range(1, self.nu + 1)]  # nu x [B, H, T, 2D]
        return torch.cat([r * p for p in rolled], dim=-1)  # [B, H, T, 2 nu D]


class Adjusted(FeatureMap):
    """Another map's features, then (each optional) divided by their sum, and for queries multiplied by a scale:

        phi'(x) = phi(x) / (sum_f phi(x)_f + sum_eps)       (queries if sum_norm_query, keys if sum_norm_key)
        phi'(q) = query_scale * phi'(q)

    Not registered: importers use it to express a foreign model's conventions (flash-linear-attention scales
    queries by F^-0.5 and can sum-normalise q and k) with the registry's maps.
    """

    def __init__(
        self, inner: FeatureMap, *, query_scale: float = 1.0, sum_norm_query: bool = False,
        sum_norm_key: bool = False, sum_eps: float = 1e-4,
    ) -> None:
        super().__init__(inner.head_dim)
        self.inner = inner
        self.query_scale = query_scale
        self.sum_norm_query = sum_norm_query
        self.sum_norm_key = sum_norm_key
        self.sum_eps = sum_eps
        self.needs_position = inner.needs_position
        self.signed = inner.signed

    @property
    def out_dim(self) -> int:
        return self.inner.out_dim

    def forward(self, x, *, is_query, positions=None):
        y = self.inner(x, is_query=is_query, positions=positions)  # [B, H, T, F]
        if self.sum_norm_query if is_query else self.sum_norm_key:
            y = y / (y.sum(-1, keepdim=True) + self.sum_eps)  # [B, H, T, F]
        return y * self.query_scale if is_query else y


__all__ = ["Adjusted", "FeatureMap", "LearnedFeatureMap", "available", "make_feature_map", "register"]
