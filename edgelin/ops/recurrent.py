"""The recurrent form: one token at a time with a fixed-size state (the decode graph).

    S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t),   y_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)
"""

from __future__ import annotations

import torch

from edgelin.feature_maps import FeatureMap
from edgelin.ops.common import State, advance, featurize, stable_divide


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
) -> tuple[torch.Tensor, State]:
    """Exactly one token. The decode graph is this function and nothing else."""
    if q.shape[2] != 1:
        raise ValueError(f"recurrent_step takes one token, got a sequence of {q.shape[2]}")
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)
    fq, fk = fq[:, :, 0], fk[:, :, 0]  # [B, H, F]
    S = state["S"] + fk[..., None] * v[:, :, 0, None, :]  # [B, H, F, Dv]
    o = torch.einsum("bhf,bhfd->bhd", fq, S)  # [B, H, Dv]
    updates = {"S": S}
    if normalize:
        z = state["z"] + fk  # [B, H, F]
        o = stable_divide(o, (fq * z).sum(-1), eps)  # [B, H, Dv]
        updates["z"] = z
    return o[:, :, None], advance(state, 1, **updates)  # [B, H, 1, Dv]


def recurrent_linear_attention(q, k, v, *, feature_map, initial_state=None, chunk_size=64, eps=1e-6, normalize=True):
    """Any length, by stepping token by token (the decode path, run over a sequence)."""
    state = initial_state
    outs = []
    for t in range(q.shape[2]):
        o, state = recurrent_step(
            q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1],
            feature_map=feature_map, initial_state=state, eps=eps, normalize=normalize,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), state  # [B, H, T, Dv]
