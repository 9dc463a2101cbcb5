"""The reference: the textbook definition, one query at a time, explicit sums over the past.

    y_t = (phi(q_t)^T S_0 + sum_{j<=t} phi(q_t)^T phi(k_j) v_j) / (phi(q_t)^T z_0 + sum_{j<=t} phi(q_t)^T phi(k_j) + eps)

O(T^2), a Python loop over t. Slow on purpose: it shares no running-sum code with the fast forms.
Run it in float64 to get a ground truth.
"""

from __future__ import annotations

import torch

from edgelin.feature_maps import FeatureMap
from edgelin.ops.common import State, advance, featurize, stable_divide


def naive_linear_attention(
    q: torch.Tensor,  # [B, H, T, Dk]
    k: torch.Tensor,  # [B, H, T, Dk]
    v: torch.Tensor,  # [B, H, T, Dv]
    *,
    feature_map: FeatureMap,
    initial_state: State | None = None,
    chunk_size: int = 64,  # unused: same signature as every form
    eps: float = 1e-6,
    normalize: bool = True,
) -> tuple[torch.Tensor, State]:
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # phi(q), phi(k): [B, H, T, F]
    T = q.shape[2]
    outs = []
    for t in range(T):
        qt = fq[:, :, t]  # [B, H, F]
        sim = torch.einsum("bhf,bhjf->bhj", qt, fk[:, :, : t + 1])  # [B, H, t+1]
        num = torch.einsum("bhf,bhfd->bhd", qt, state["S"]) + torch.einsum("bhj,bhjd->bhd", sim, v[:, :, : t + 1])  # [B, H, Dv]
        if normalize:
            den = torch.einsum("bhf,bhf->bh", qt, state["z"]) + sim.sum(-1)  # [B, H]
            num = stable_divide(num, den, eps)
        outs.append(num)
    o = torch.stack(outs, dim=2)  # [B, H, T, Dv]
    updates = {"S": state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk, v)}  # [B, H, F, Dv]
    if normalize:
        updates["z"] = state["z"] + fk.sum(2)  # [B, H, F]
    return o, advance(state, T, **updates)
