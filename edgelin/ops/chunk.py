"""The chunked parallel form (the prefill graph): O(T) work, no Python loop over time.

The sequence is cut into n chunks of C tokens. Within a chunk, a masked (causal) product phi(Q) phi(K)^T;
across chunks, the state each chunk starts from is an exclusive cumulative sum of the per-chunk
phi(K)^T V, plus the initial state. The sequence is zero-padded to a multiple of C *after* the feature
map: phi(0) is not zero for every map (elu+1 gives 1), and a padded key must add nothing to S or z.

With a log-decay g (``g=None`` takes the undecayed code above, op for op):

- Every decay is exp of a *window sum* of g, never a difference of two long running sums and never
  the exp of a positive number: ``relative_log_decay`` builds L_ij = sum_{j < s <= i} g_s as a masked
  cumsum and sets the future to -inf before the exp. Measured in float32 against the float64 naive
  form, on a gate of -30 for 7/8 of each chunk and ~1 after it (T = 512): 1.0e-7 relative with window
  sums, 8.2e-7 (C = 64) and 9.5e-7 (C = 256) with differences of running sums b_i - b_j. Inside chunk n
  (positions i, j):
      intra:      A_ij = phi(q_i)^T diag(exp L_ij) phi(k_j)                       (j <= i)
      from state: phi(q_i)^T diag(exp b_i) S_n,   b_i = sum_{s <= i} g_s           (prefix in the chunk)
      chunk's kv: U_n = sum_j diag(exp L_{C-1, j}) phi(k_j) v_j^T                 (each key decayed to the chunk end)
- Across chunks (the state S_n each chunk starts from) a second, chunk-level decay matrix on the chunk
  totals c_m = b_{C-1} of chunk m, with the initial state as item 0:
      [S_0, S_1, ..., S_n] = exp(L') @ [S_init, U_0, ..., U_{n-1}],   L' = relative_log_decay([0, c_0, ..., c_{n-1}])
  Quadratic in the number of chunks n = T / C, but no loop and no data-dependent count, so it exports.
  The runtime prefills long prompts in pieces of a few thousand tokens, which bounds n.
- The normaliser rides along as one more column of v (ones) and of S (z): same products, one pass.
- Padding: g is padded with 0 (no decay), phi(k) and v with zeros, so padded steps change nothing.
  Rows of different lengths (``lengths`` [B], right padding) take the same path: their padded positions
  are zeroed the same way (edgelin.ops.lengths) before the chunking.

Memory per batch row and head, in elements (F = feature width, Dv' = Dv + 1 with the normaliser):
    per-head g:     intra decay [n, C, C] = T C,        chunk decay [n+1, n+1],      chunk states [n+1, F, Dv']
    per-feature g:  intra decay [n, C, C, F] = T C F,   chunk decay [n+1, n+1, F],   chunk states [n+1, F, Dv']
(plus the undecayed form's own A [n, C, C] and products; a few temporaries of the decay's size live at
once while it is built: the masked window, its cumsum, its exp). The per-feature intra tensor is the heavy one:
at T = 4096, C = 64, F = 64 it is 16.8 M elements (64 MiB float32) per head, against 256 Ki elements for a
per-head g. For per-feature gates use a smaller chunk (16-32: T C F = 4.2-8.4 M at T = 4096) and keep
prefill pieces to a few thousand tokens; the chunk-level part grows as (T/C)^2 F, so C = 16 at T = 4096
costs 66 Ki x F = 4.2 M elements there too. Two-level (sub-chunk) tiling would cut T C F further and is
not done here. Measured peak memory growth of one call in eager PyTorch (one head, T = 4096, F = Dv = 64,
float32, no normaliser): per-head g 16 MiB at C = 64; per-feature g 258 MiB (C = 64), 131 MiB (C = 32),
85 MiB (C = 16), i.e. about four decay-sized temporaries at the peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from edgelin.ops import fused
from edgelin.ops.fused import fused_additive
from edgelin.ops.common import State, advance, check_decay, featurize, relative_log_decay, stable_divide
from edgelin.ops.lengths import mask_padding, steps

if TYPE_CHECKING:  # the ops take any feature map object; the maps (edgelin.layers) build on the ops
    from edgelin.layers.feature_maps import FeatureMap


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
    g: torch.Tensor | None = None,  # [B, H, T] or [B, H, T, F] log-decay, <= 0
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    g = check_decay(g, q, feature_map)
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # phi(q), phi(k): [B, H, T, F]
    if fused.active() and lengths is None:  # the fused lowering (edgelin.ops.fused); a ragged batch stays portable
        return fused_additive(state, fq, fk, v, g, eps, normalize, feature_map.signed)
    fk, v, g = mask_padding(fk, v, g, lengths)  # padded positions add nothing and do not decay
    if g is not None:
        return _chunk_decayed(fq, fk, v, g, state, chunk_size, eps, normalize, steps(q.shape[2], lengths))
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
    return o, advance(state, steps(T, lengths), **updates)


def _chunk_decayed(fq, fk, v, g, state, C, eps, normalize, length):
    B, H, T, f = fq.shape
    n = (T + C - 1) // C
    pad = n * C - T
    per_feature = g.dim() == 4
    S0 = state["S"]  # [B, H, F, Dv]
    if normalize:  # the normaliser as one more value column: z is the state of a value that is always 1
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, H, T, Dv+1]
        S0 = torch.cat([S0, state["z"][..., None]], dim=-1)  # [B, H, F, Dv+1]
    dv = v.shape[-1]
    fq = F.pad(fq, (0, 0, 0, pad)).reshape(B, H, n, C, f)  # [B, H, n, C, F]
    fk = F.pad(fk, (0, 0, 0, pad)).reshape(B, H, n, C, f)  # [B, H, n, C, F]
    vc = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, C, dv)  # [B, H, n, C, Dv']
    if per_feature:
        gc = F.pad(g, (0, 0, 0, pad)).reshape(B, H, n, C, f)  # [B, H, n, C, F]
    else:
        gc = F.pad(g, (0, pad)).reshape(B, H, n, C)  # [B, H, n, C]

    L = relative_log_decay(gc, dim=3)  # [B, H, n, C, C(, F)], -inf above the diagonal
    decay = L.exp()  # [B, H, n, C, C(, F)]
    b = gc.cumsum(3)  # [B, H, n, C(, F)]: log-decay from the chunk start through each step
    to_end = decay[:, :, :, -1]  # [B, H, n, C(, F)]: from each step to the chunk end
    if per_feature:
        A = torch.einsum("bhnijf,bhnjf->bhnij", fq[:, :, :, :, None] * decay, fk)  # [B, H, n, C, C]
        fq0 = fq * b.exp()  # [B, H, n, C, F]
        fk_end = fk * to_end  # [B, H, n, C, F]
    else:
        A = torch.einsum("bhnif,bhnjf->bhnij", fq, fk) * decay  # [B, H, n, C, C]
        fq0 = fq * b.exp()[..., None]  # [B, H, n, C, F]
        fk_end = fk * to_end[..., None]  # [B, H, n, C, F]
    kv = torch.einsum("bhncf,bhncd->bhnfd", fk_end, vc)  # [B, H, n, F, Dv']

    items = torch.cat([S0[:, :, None], kv], dim=2)  # [B, H, n+1, F, Dv']: initial state, then each chunk's kv
    totals = b[:, :, :, -1]  # [B, H, n(, F)]: log-decay across each chunk
    totals = torch.cat([torch.zeros_like(totals[:, :, :1]), totals], dim=2)  # [B, H, n+1(, F)]
    across = relative_log_decay(totals, dim=2).exp()  # [B, H, n+1, n+1(, F)]
    if per_feature:
        states = torch.einsum("bhamf,bhmfd->bhafd", across, items)  # [B, H, n+1, F, Dv']
    else:
        states = torch.einsum("bham,bhmfd->bhafd", across, items)  # [B, H, n+1, F, Dv']

    o = torch.einsum("bhncf,bhnfd->bhncd", fq0, states[:, :, :-1]) + A @ vc  # [B, H, n, C, Dv']
    o = o.reshape(B, H, n * C, dv)[:, :, :T]  # [B, H, T, Dv']
    final = states[:, :, -1]  # [B, H, F, Dv']
    if not normalize:
        return o, advance(state, length, S=final)
    o = stable_divide(o[..., :-1], o[..., -1], eps)  # [B, H, T, Dv]
    return o, advance(state, length, S=final[..., :-1], z=final[..., -1])
