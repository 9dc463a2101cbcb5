"""The quadratic parallel form: the full masked T x T product, as softmax attention would do it.

Memory O(T^2): a baseline for benchmarks and a second reference, not a deployment path.
"""

from __future__ import annotations

import torch

from edgelin.feature_maps import FeatureMap
from edgelin.ops.common import State, advance, featurize, stable_divide


def parallel_linear_attention(
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
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [T, T]
    A = torch.einsum("bhtf,bhsf->bhts", fq, fk) * causal  # [B, H, T, T]
    o = torch.einsum("bhtf,bhfd->bhtd", fq, state["S"]) + A @ v  # [B, H, T, Dv]
    updates = {"S": state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk, v)}  # [B, H, F, Dv]
    if normalize:
        den = torch.einsum("bhtf,bhf->bht", fq, state["z"]) + A.sum(-1)  # [B, H, T]
        o = stable_divide(o, den, eps)
        updates["z"] = state["z"] + fk.sum(2)  # [B, H, F]
    return o, advance(state, T, **updates)
