"""The recurrent form: one token at a time with a fixed-size state (the decode graph).

    S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t),   y_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)

With a log-decay g the old state is scaled first: S_t = exp(g_t) * S_{t-1} + phi(k_t) v_t^T (a per-feature
g scales the rows of S), and z likewise. Two more ops per step (Exp, Mul) and none when g is None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgelin.ops import fused
from edgelin.ops.fused import fused_additive
from edgelin.ops.common import State, advance, check_decay, featurize, padded_denominator

if TYPE_CHECKING:  # the ops take any feature map object; the maps (edgelin.layers) build on the ops
    from edgelin.layers.feature_maps import FeatureMap


def recurrent_step(
    q: torch.Tensor,  # [B, H, 1, Dk]
    k: torch.Tensor,  # [B, H, 1, Dk]
    v: torch.Tensor,  # [B, H, 1, Dv]
    *,
    feature_map: FeatureMap,
    initial_state: State | None = None,
    chunk_size: int = 64,  # unused: same signature as every form
    eps: float = 1e-6,
    normalize: bool = True,
    g: torch.Tensor | None = None,  # [B, H, 1] or [B, H, 1, F] log-decay, <= 0
) -> tuple[torch.Tensor, State]:
    """Exactly one token. The decode graph is this function and nothing else, and ONNX Runtime pays a
    fixed cost per node at this size, so every tensor keeps its token axis: the products are MatMuls
    over [B, H, 1, .] (no Gather of token 0, no Einsum), and for a non-negative map the denominator
    is one Add (``padded_denominator``)."""
    if q.shape[2] != 1:
        raise ValueError(f"recurrent_step takes one token, got a sequence of {q.shape[2]}")
    g = check_decay(g, q, feature_map)
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # [B, H, 1, F]
    if fused.active():  # the fused lowering (edgelin.ops.fused)
        return fused_additive(state, fq, fk, v, g, eps, normalize, feature_map.signed)
    S, z = state["S"], state.get("z")
    if g is not None:
        a = g.exp()  # [B, H, 1] or [B, H, 1, F]
        per_feature = g.dim() == 4
        S = (a.transpose(-1, -2) if per_feature else a[..., None]) * S  # rows of S: [B, H, F, 1] or [B, H, 1, 1]
        if normalize:
            z = (a[:, :, 0] if per_feature else a) * z  # [B, H, F]
    S = S + fk.transpose(-1, -2) * v  # [B, H, F, 1] x [B, H, 1, Dv] -> [B, H, F, Dv]
    o = fq @ S  # [B, H, 1, Dv]
    updates = {"S": S}
    if normalize:
        z = z + fk[:, :, 0]  # [B, H, F]
        o = o / padded_denominator(fq @ z[..., None], eps, feature_map.signed)  # [B, H, 1, Dv] / [B, H, 1, 1]
        updates["z"] = z
    return o, advance(state, 1, **updates)  # [B, H, 1, Dv]


def recurrent_linear_attention(q, k, v, *, feature_map, initial_state=None, chunk_size=64, eps=1e-6, normalize=True, g=None):
    """Any length, by stepping token by token (the decode path, run over a sequence)."""
    g = check_decay(g, q, feature_map)
    state = initial_state
    outs = []
    for t in range(q.shape[2]):
        o, state = recurrent_step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
            feature_map=feature_map, initial_state=state, eps=eps, normalize=normalize,
            g=None if g is None else g[:, :, t : t + 1],
        )
        outs.append(o)
    return torch.cat(outs, dim=2), state  # [B, H, T, Dv]
