"""The reference: the textbook definition, one query at a time, explicit sums over the past.

    y_t = (phi(q_t)^T S_0 + sum_{j<=t} phi(q_t)^T phi(k_j) v_j) / (phi(q_t)^T z_0 + sum_{j<=t} phi(q_t)^T phi(k_j) + eps)

With a log-decay g, every past term is weighted by its decay to step t (per feature for a [B, H, T, F] g):

    y_t = (phi(q_t)^T D_t0 S_0 + sum_{j<=t} phi(q_t)^T D_tj phi(k_j) v_j) / (... the same with z_0 and 1 ...)
    D_tj = diag(exp(sum_{j < s <= t} g_s)),   D_t0 = diag(exp(sum_{s <= t} g_s))

O(T^2), a Python loop over t. Slow on purpose: it shares no running-sum code with the fast forms (each
window sum is summed from step t backwards, afresh for every t). Run it in float64 to get a ground truth.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgelin.ops.common import State, advance, check_decay, featurize, stable_divide
from edgelin.ops.lengths import mask_padding, steps

if TYPE_CHECKING:  # the ops take any feature map object; the maps (edgelin.layers) build on the ops
    from edgelin.layers.feature_maps import FeatureMap


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
    g: torch.Tensor | None = None,  # [B, H, T] or [B, H, T, F] log-decay, <= 0
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    g = check_decay(g, q, feature_map)
    state, fq, fk = featurize(q, k, v, feature_map, initial_state, normalize)  # phi(q), phi(k): [B, H, T, F]
    fk, v, g = mask_padding(fk, v, g, lengths)  # padded positions add nothing and do not decay (edgelin.ops.lengths)
    if g is not None:
        return _naive_decayed(fq, fk, v, g, state, eps, normalize, steps(q.shape[2], lengths))
    T = q.shape[2]
    outs = []
    for t in range(T):
        qt = fq[:, :, t]  # [B, H, F]
        sim = torch.einsum("bhf,bhjf->bhj", qt, fk[:, :, : t + 1])  # [B, H, t+1]
        outs.append(_readout(qt, sim, v[:, :, : t + 1], state, eps, normalize))
    o = torch.stack(outs, dim=2)  # [B, H, T, Dv]
    updates = {"S": state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk, v)}  # [B, H, F, Dv]
    if normalize:
        updates["z"] = state["z"] + fk.sum(2)  # [B, H, F]
    return o, advance(state, steps(T, lengths), **updates)


def _window_log_decay(g: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_{j < s <= t} g_s for j = 0..t  [B, H, t+1(, F)],  sum_{s <= t} g_s  [B, H(, F)]), from t backwards."""
    back = g[:, :, : t + 1].flip(2)  # [B, H, t+1(, F)]: g_t, g_{t-1}, ..., g_0
    through = back.cumsum(2)  # [B, H, t+1(, F)]: sum_{s >= t-i} g_s
    to_t = torch.cat([torch.zeros_like(through[:, :, :1]), through[:, :, :-1]], dim=2).flip(2)  # [B, H, t+1(, F)]
    return to_t, through[:, :, -1]


def _readout(q0, sim, v, state, eps, normalize):
    """One query's output from its (decayed) similarities to every key so far and the initial state:
    q0 [B, H, F] (the query, decayed to the start), sim [B, H, t+1], v [B, H, t+1, Dv] -> [B, H, Dv]."""
    num = torch.einsum("bhf,bhfd->bhd", q0, state["S"]) + torch.einsum("bhj,bhjd->bhd", sim, v)  # [B, H, Dv]
    if normalize:
        den = torch.einsum("bhf,bhf->bh", q0, state["z"]) + sim.sum(-1)  # [B, H]
        num = stable_divide(num, den, eps)
    return num


def _naive_decayed(fq, fk, v, g, state, eps, normalize, length):
    per_feature = g.dim() == 4
    T = fq.shape[2]
    outs = []
    for t in range(T):
        to_t, from_start = _window_log_decay(g, t)  # [B, H, t+1(, F)], [B, H(, F)]
        if per_feature:
            qk = fq[:, :, t, None] * fk[:, :, : t + 1]  # [B, H, t+1, F]
            sim = (qk * to_t.exp()).sum(-1)  # [B, H, t+1]
            q0 = fq[:, :, t] * from_start.exp()  # [B, H, F]
        else:
            sim = torch.einsum("bhf,bhjf->bhj", fq[:, :, t], fk[:, :, : t + 1]) * to_t.exp()  # [B, H, t+1]
            q0 = fq[:, :, t] * from_start.exp()[..., None]  # [B, H, F]
        outs.append(_readout(q0, sim, v[:, :, : t + 1], state, eps, normalize))
    o = torch.stack(outs, dim=2)  # [B, H, T, Dv]
    to_end, total = _window_log_decay(g, T - 1)  # [B, H, T(, F)], [B, H(, F)]
    if not per_feature:
        to_end, total = to_end[..., None], total[..., None]  # [B, H, T, 1], [B, H, 1]
    fk_end = fk * to_end.exp()  # [B, H, T, F]: each key decayed to the last step
    updates = {"S": total.exp()[..., None] * state["S"] + torch.einsum("bhtf,bhtd->bhfd", fk_end, v)}  # [B, H, F, Dv]
    if normalize:
        updates["z"] = total.exp() * state["z"] + fk_end.sum(2)  # [B, H, F]
    return o, advance(state, length, **updates)
