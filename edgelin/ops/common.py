"""Pieces shared by every form of linear attention: the state, positions, the stabilised division.

State (a plain dict, one per attention layer):
    "S"   [B, H, F, Dv]  running sum of phi(k_t) v_t^T
    "z"   [B, H, F]      running sum of phi(k_t)             (only with normalize=True)
    "pos" [B]   int64    tokens seen so far                   (only for maps that need positions)
Every form returns a new dict; no state tensor is updated in place.
"""

from __future__ import annotations

import torch

from edgelin.feature_maps import FeatureMap

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


def stable_divide(num: torch.Tensor, den: torch.Tensor, eps: float) -> torch.Tensor:
    """num / (den + eps), with eps taking the sign of den.

    For non-negative feature maps den >= 0, so this is exactly the textbook num / (den + eps). For signed
    maps (identity) den can approach zero from either side; pushing it *away* from zero keeps
    |den| >= eps, so the output is bounded by |num| / eps instead of exploding through a sign change.
    """
    den = torch.where(den >= 0, den + eps, den - eps)  # not where(den >= 0, eps, -eps): that rounds eps to float32
    return num / den[..., None]


def advance(state: State, length: int, **updates: torch.Tensor) -> State:
    """The state after ``length`` more tokens: new tensors for S (and z), the position moved on."""
    new = dict(updates)
    if "pos" in state:
        new["pos"] = state["pos"] + length
    return {name: new[name] for name in state}
