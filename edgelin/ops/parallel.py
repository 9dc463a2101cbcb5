"""The quadratic parallel form: the full masked T x T product, as softmax attention would do it.

Memory O(T^2): a baseline for benchmarks and a second reference, not a deployment path. With a log-decay
g the mask becomes the decay matrix exp(L), L_ts = sum_{s < r <= t} g_r (-inf above the diagonal, set
before the exp); a per-feature g makes it [T, T, F], O(T^2 F) memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgelin.ops.common import State, advance, check_decay, featurize, relative_log_decay, stable_divide
from edgelin.ops.lengths import mask_padding, steps

if TYPE_CHECKING:  # the ops take any feature map object; the maps (edgelin.layers) build on the ops
    from edgelin.layers.feature_maps import FeatureMap


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
    g: torch.Tensor | None = None,  # [B, H, T] or [B, H, T, F] log-decay, <= 0
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    g = check_decay(g, q, feature_map)
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # phi(q), phi(k): [B, H, T, F]
    fk, v, g = mask_padding(fk, v, g, lengths)  # padded positions add nothing and do not decay (edgelin.ops.lengths)
    if g is not None:
        return _parallel_decayed(fq, fk, v, g, state, eps, normalize, steps(q.shape[2], lengths))
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()  # [T, T]
    A = torch.einsum("bhtf,bhsf->bhts", fq, fk) * causal  # [B, H, T, T]
    o = torch.einsum("bhtf,bhfd->bhtd", fq, state["S"]) + A @ v  # [B, H, T, Dv]
    updates = {"S": state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk, v)}  # [B, H, F, Dv]
    if normalize:
        den = torch.einsum("bhtf,bhf->bht", fq, state["z"]) + A.sum(-1)  # [B, H, T]
        o = stable_divide(o, den, eps)
        updates["z"] = state["z"] + fk.sum(2)  # [B, H, F]
    return o, advance(state, steps(T, lengths), **updates)


def _parallel_decayed(fq, fk, v, g, state, eps, normalize, length):
    decay = relative_log_decay(g, dim=2).exp()  # [B, H, T, T(, F)], zero above the diagonal
    from_start = g.cumsum(2).exp()  # [B, H, T(, F)]
    if g.dim() == 4:
        A = torch.einsum("bhtsf,bhsf->bhts", fq[:, :, :, None] * decay, fk)  # [B, H, T, T]
    else:
        A = torch.einsum("bhtf,bhsf->bhts", fq, fk) * decay  # [B, H, T, T]
        from_start = from_start[..., None]  # [B, H, T, 1]
    fq0 = fq * from_start  # [B, H, T, F]: the query seen from the initial state
    to_end = decay[:, :, -1]  # [B, H, T(, F)]: decay from each step to the last
    fk_end = fk * (to_end if g.dim() == 4 else to_end[..., None])  # [B, H, T, F]
    total = from_start[:, :, -1]  # [B, H, F] or [B, H, 1]
    o = torch.einsum("bhtf,bhfd->bhtd", fq0, state["S"]) + A @ v  # [B, H, T, Dv]
    updates = {"S": total[..., None] * state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk_end, v)}  # [B, H, F, Dv]
    if normalize:
        den = torch.einsum("bhtf,bhf->bht", fq0, state["z"]) + A.sum(-1)  # [B, H, T]
        o = stable_divide(o, den, eps)
        updates["z"] = total * state["z"] + fk_end.sum(2)  # [B, H, F]
    return o, advance(state, length, **updates)
