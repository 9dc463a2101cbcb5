"""Pieces shared by every form of linear attention: the state, positions, the stabilised division.

State (a plain dict, one per attention layer):
    "S"   [B, H, F, Dv]  running sum of phi(k_t) v_t^T
    "z"   [B, H, F]      running sum of phi(k_t)             (only with normalize=True)
    "pos" [B]   int64    tokens seen so far                   (only for maps that need positions)
Every form returns a new dict; no state tensor is updated in place.

Decay (optional, every form): a per-step log-decay g <= 0, either per head [B, H, T] (RetNet's fixed
gamma as g = log(gamma), Mamba2 / simple GLA's data-dependent scalar) or per feature [B, H, T, F] with F
the feature map's output width (GLA). It is applied before the new token is added:
    S_t = exp(g_t) * S_{t-1} + phi(k_t) v_t^T,   z_t = exp(g_t) * z_{t-1} + phi(k_t)
(a per-feature g scales the rows of S and the entries of z). g = None is the undecayed form, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the ops take any feature map object; the maps (edgelin.layers) build on the ops
    from edgelin.layers.feature_maps import FeatureMap

State = dict[str, torch.Tensor]


def state_layout(feature_map: FeatureMap, *, n_heads: int, value_dim: int, normalize: bool) -> dict[str, tuple]:
    """name -> (shape with "batch" for the batch dim, dtype name, init value) of one layer's state."""
    f = feature_map.out_dim
    layout: dict[str, tuple] = {"S": (("batch", n_heads, f, value_dim), "float32", 0.0)}
    if normalize:
        layout["z"] = (("batch", n_heads, f), "float32", 0.0)
    if feature_map.needs_position:
        layout["pos"] = (("batch",), "int64", 0)
    return layout


def init_state(
    feature_map: FeatureMap,
    *,
    batch: int,
    n_heads: int,
    value_dim: int,
    normalize: bool,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> State:
    state: State = {}
    for name, (shape, dtype_name, init) in state_layout(
        feature_map, n_heads=n_heads, value_dim=value_dim, normalize=normalize
    ).items():
        dims = tuple(batch if d == "batch" else d for d in shape)
        t_dtype = torch.int64 if dtype_name == "int64" else dtype
        state[name] = torch.full(dims, init, dtype=t_dtype, device=device)
    return state


def resolve_state(q: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, initial_state: State | None, normalize: bool) -> State:
    if initial_state is not None:
        return initial_state
    b, h = q.shape[:2]
    return init_state(feature_map, batch=b, n_heads=h, value_dim=v.shape[-1], normalize=normalize, dtype=q.dtype, device=q.device)


def positions(state: State, feature_map: FeatureMap, length: int, device: torch.device) -> torch.Tensor | None:
    """Absolute positions [B, T] of the next ``length`` tokens, or None if the map does not use them."""
    if not feature_map.needs_position:
        return None
    return state["pos"][:, None] + torch.arange(length, device=device)[None, :]  # [B, T]


def featurize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, initial_state: State | None, normalize: bool
) -> tuple[State, torch.Tensor, torch.Tensor]:
    """The prologue of every form: (state to start from, phi(q) [B, H, T, F], phi(k) [B, H, T, F])."""
    state = resolve_state(q, v, feature_map, initial_state, normalize)
    pos = positions(state, feature_map, q.shape[2], q.device)
    return state, feature_map(q, is_query=True, positions=pos), feature_map(k, is_query=False, positions=pos)


def check_decay(g: torch.Tensor | None, q: torch.Tensor, feature_map: FeatureMap) -> torch.Tensor | None:
    """g itself (cast to q's dtype) if its shape is [B, H, T] or [B, H, T, F]; else a ValueError.

    The shape must match exactly: a [B, 1, T] or [H, T] g would broadcast silently into a different model.
    Whether g <= 0 is data, not checked here; a positive g is a growth, and the chunked form's
    stability argument (no exp of a positive number) needs g <= 0.
    """
    if g is None:
        return None
    B, H, T = q.shape[:3]
    f = feature_map.out_dim
    if not g.is_floating_point() or tuple(g.shape) not in ((B, H, T), (B, H, T, f)):
        raise ValueError(
            f"g (log-decay) must be a float tensor of shape [B, H, T] = [{B}, {H}, {T}] (per head) or "
            f"[B, H, T, F] = [{B}, {H}, {T}, {f}] (per feature of the {feature_map.name!r} map); "
            f"got {g.dtype} {list(g.shape)}"
        )
    return g.to(q.dtype)


def relative_log_decay(g: torch.Tensor, dim: int) -> torch.Tensor:
    """L[..., i, j, ...] = sum_{j < s <= i} g_s for j <= i and -inf for j > i, along time axis ``dim``.

    The result has one more axis than g: rows i at ``dim``, columns j at ``dim + 1`` (a trailing feature
    axis stays last). exp(L) is the decay from step j to step i. Each entry is a sum over its own
    window (a masked cumsum), not a difference of two running sums, so a short window keeps full
    relative precision however much decay came before it; and the future is set to -inf *before*
    any exp, so no exp of a positive number happens for g <= 0.
    """
    n = g.shape[dim]
    trailing = [1] * (g.dim() - dim - 1)
    ones = torch.ones(n, n, dtype=torch.bool, device=g.device)
    strict = ones.tril(-1).reshape(n, n, *trailing)  # [n, n, (1)]: s = i counts towards columns j < i
    causal = ones.tril().reshape(n, n, *trailing)  # [n, n, (1)]
    rows = g.unsqueeze(dim + 1).expand(*g.shape[: dim + 1], n, *g.shape[dim + 1 :])  # [..., n(i), n(j), ...]: g_i
    L = torch.cumsum(torch.where(strict, rows, 0.0), dim=dim)  # [..., n, n, ...]
    return torch.where(causal, L, float("-inf"))  # [..., n, n, ...]


def padded_denominator(den: torch.Tensor, eps: float, signed: bool = True) -> torch.Tensor:
    """den + eps, with eps taking the sign of den when the feature map is ``signed``.

    For non-negative feature maps den >= 0, so this is exactly the textbook den + eps (one Add in a graph;
    the decode graph relies on that). For signed maps (identity) den can approach zero from either side;
    pushing it *away* from zero keeps |den| >= eps, so the output is bounded by |num| / eps instead of
    exploding through a sign change.
    """
    if not signed:
        return den + eps
    return torch.where(den >= 0, den + eps, den - eps)  # not where(den >= 0, eps, -eps): that rounds eps to float32


def stable_divide(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (den + eps) with den of num's shape less its last axis, eps taking the sign of den
    (``padded_denominator``: the same result for any map, signed or not)."""
    return num / padded_denominator(den, eps)[..., None]


def advance(state: State, length: int, **updates: torch.Tensor) -> State:
    """The state after ``length`` more tokens: new tensors for S (and z), the position moved on."""
    new = dict(updates)
    if "pos" in state:
        new["pos"] = state["pos"] + length
    return {name: new[name] for name in state}
