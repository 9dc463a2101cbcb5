"""The chunked parallel form (the prefill graph): O(T) work, no Python loop over time.

The sequence is cut into n chunks of C tokens. Within a chunk, a masked (causal) product phi(Q) phi(K)^T;
across chunks, the state each chunk starts from is an exclusive cumulative sum of the per-chunk
phi(K)^T V, plus the initial state. The sequence is zero-padded to a multiple of C *after* the feature
map: phi(0) is not zero for every map (elu+1 gives 1), and a padded key must add nothing to S or z.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgelin.feature_maps import FeatureMap
from edgelin.ops.common import State, advance, featurize, stable_divide


def _exclusive_cumsum(x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Along dim 2 (chunks): the value *before* each chunk, start included, and the total after the last."""
    inclusive = torch.cumsum(x, dim=2)  # [B, H, n, ...]
    before = torch.cat([torch.zeros_like(x[:, :, :1]), inclusive[:, :, :-1]], dim=2)  # [B, H, n, ...]
    return start[:, :, None] + before, start + inclusive[:, :, -1]


def chunk_linear_attention(
    q: torch.Tensor,  # [B, H, T, Dk]
    k: torch.Tensor,  # [B, H, T, Dk]
    v: torch.Tensor,  # [B, H, T, Dv]
    *,
    feature_map: FeatureMap,
    initial_state: State | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
    normalize: bool = True,
) -> tuple[torch.Tensor, State]:
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # phi(q), phi(k): [B, H, T, F]
    B, H, T, _ = q.shape
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    fq = F.pad(fq, (0, 0, 0, pad)).reshape(B, H, n, C, fq.shape[-1])  # [B, H, n, C, F]
    fk = F.pad(fk, (0, 0, 0, pad)).reshape(B, H, n, C, fk.shape[-1])  # [B, H, n, C, F]
    vc = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, C, v.shape[-1])  # [B, H, n, C, Dv]

    kv = torch.einsum("bhncf,bhncd->bhnfd", fk, vc)  # [B, H, n, F, Dv]
    S_before, S_final = _exclusive_cumsum(kv, state["S"])  # [B, H, n, F, Dv], [B, H, F, Dv]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C, C]
    A = torch.einsum("bhncf,bhnsf->bhncs", fq, fk) * causal  # [B, H, n, C, C]
    o = torch.einsum("bhncf,bhnfd->bhncd", fq, S_before) + torch.einsum("bhncs,bhnsd->bhncd", A, vc)  # [B, H, n, C, Dv]
    updates = {"S": S_final}
    if normalize:
        z_before, z_final = _exclusive_cumsum(fk.sum(3), state["z"])  # [B, H, n, F], [B, H, F]
        den = torch.einsum("bhncf,bhnf->bhnc", fq, z_before) + A.sum(-1)  # [B, H, n, C]
        o = stable_divide(o, den, eps)
        updates["z"] = z_final
    o = o.reshape(B, H, n * C, v.shape[-1])[:, :, :T]  # [B, H, T, Dv]
    return o, advance(state, T, **updates)
