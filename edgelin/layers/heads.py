"""Heads: splitting a projection into (grouped) heads, and a state kept per key/value head shared by its query heads."""

from __future__ import annotations

import torch

from edgelin.state import State


def split_heads(x: torch.Tensor, heads: int, dim: int, groups: int = 1) -> torch.Tensor:
    """[B, T, heads * dim] -> [B, heads * groups, T, dim]: each head repeated ``groups`` times in a row (query
    head h reads key/value head h // groups)."""
    B, T, _ = x.shape
    x = x.view(B, T, heads, dim).transpose(1, 2)  # [B, heads, T, dim]
    if groups == 1:
        return x
    return x[:, :, None].expand(B, heads, groups, T, dim).reshape(B, heads * groups, T, dim)  # [B, H, T, dim]


def share_state(state: State, groups: int) -> State:
    """Per key/value head -> per query head (query head h reads key/value head h // groups)."""
    if groups == 1:
        return state
    out = {}
    for name, t in state.items():
        B, Hkv, *rest = t.shape
        out[name] = t[:, :, None].expand(B, Hkv, groups, *rest).reshape(B, Hkv * groups, *rest)  # [B, H, ...]
    return out


def unshare_state(state: State, groups: int) -> State:
    """Per query head -> per key/value head: the heads of a group built identical states; keep the first."""
    if groups == 1:
        return state
    return {name: t[:, ::groups] for name, t in state.items()}  # [B, Hkv, ...]


__all__ = ["share_state", "split_heads", "unshare_state"]
