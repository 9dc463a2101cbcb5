"""The generalised delta rule with a diagonal-plus-rank-one transition (DPLR; RWKV-7's recurrence) in four forms
with one signature:

    fn(q, k, v, a, b, w, *, initial_state=None, chunk_size=16, scale=1.0, lengths=None) -> (o, final_state)

- ``naive_dplr``: the textbook recurrence with the K x K transition matrix; the reference (use float64).
- ``chunk_dplr``: the chunked WY form, no loop over tokens; the prefill graph.
- ``recurrent_dplr`` / ``dplr_step``: token by token; ``dplr_step`` (exactly one token) is the decode graph.

The recurrence, per head, with the state S [K, V] (key-major, as edgelin's delta rule and ONNX Runtime's
LinearAttention):

    S_t = diag(exp w_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,     o_t = scale * S_t^T q_t

i.e. the transition diag(exp w_t) + b_t a_t^T (diagonal plus rank one). ``a`` reads the state *before* this step's
decay (fla's ``dplr_recurrence`` and its fused_recurrent kernel: both read the old state). w [B, H, T, K] is a
log-decay <= 0 per key channel per step. RWKV-7 (fla's ``RWKV7Attention``) passes q = r, a = -kk, b = kk * a_lr
(kk the L2-normalised key, a_lr in (0, 1)), w = -exp(-0.5) * sigmoid(.) and scale 1; then the rank-one part is
-lr kk kk^T, the delta rule's removal along kk with a per-channel learning rate.

Inputs are [B, H, T, D] (edgelin's layout); fla's kernels take [B, T, H, D] and its naive reference [B, H, T, D].
State "S" [B, H, K, V], key-major: fla's DPLR and RWKV-7 ops (``initial_state`` / ``final_state``, their kernels'
[K, V] tiles) and the RWKV-7 layer's cache (``recurrent_state``, the ops' state as it is) use the same layout. The
RWKV-7 papers write the state value-major (S [V, K], S <- S diag(e^w) + (S a) b^T + v k^T): that is the transpose.
``scale`` multiplies q (fla's ``dplr_recurrence`` always uses K^-0.5; RWKV-7 passes 1).

``lengths`` ([B] int64, right padding; naive and chunk) makes a ragged batch: on the padding w = 0 and a = b = k = 0,
which makes each padded step the identity map (no decay, no write), so every row's final state is that of its own
tokens. The chunk form pads to a multiple of C the same way. ORT's LinearAttention has no DPLR update rule, so
``--ops fused`` leaves these forms portable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgelin.ops.common import State, relative_log_decay
from edgelin.ops.delta import chunk_states, scan_levels, unit_lower_inverse
from edgelin.ops.lengths import padding_mask

# The chunk form materialises per-channel relative decays [B, H, n, C, C, K]: T * C * K numbers per head (C = 16,
# K = 64: 1024 per token per head, 4 MB per head at T = 1000 in float32), and the scan across chunks composes
# K x K maps (~2 K^3 per chunk). C = 16 balances the two (C = 64 would make the decay tensor 4x larger, C = 8 the
# scan 2x longer) and keeps the in-chunk inverse of (I - M_ab) small and well conditioned.
DEFAULT_CHUNK = 16


def dplr_state_layout(*, n_heads: int, key_dim: int, value_dim: int) -> dict[str, tuple]:
    """name -> (shape with "batch" for the batch dim, dtype name, init value) of one DPLR layer's state."""
    return {"S": (("batch", n_heads, key_dim, value_dim), "float32", 0.0)}


def _prologue(q, k, v, a, b, w, initial_state, scale, lengths):
    """Checks shapes; returns (q scaled, k, a, b, w, S0) in q's dtype with w = a = b = k = 0 on padding."""
    if q.dim() != 4 or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q must be [B, H, T, K] and v [B, H, T, V] with the same B, H, T; got q {list(q.shape)}, v {list(v.shape)}"
        )
    B, H, T, K = q.shape
    for name, x in (("k", k), ("a", a), ("b", b), ("w (log-decay)", w)):
        if not x.is_floating_point() or tuple(x.shape) != (B, H, T, K):
            raise ValueError(
                f"{name} must be a float tensor of shape [B, H, T, K] = [{B}, {H}, {T}, {K}]; got {x.dtype} {list(x.shape)}"
            )
    k, a, b, w = (x.to(q.dtype) for x in (k, a, b, w))
    if lengths is not None:
        real = padding_mask(lengths, T)[:, None, :, None]  # [B, 1, T, 1]
        k, a, b, w = (torch.where(real, x, 0.0) for x in (k, a, b, w))  # [B, H, T, K]: a padded step is the identity
    if scale != 1.0:
        q = q * scale
    V = v.shape[-1]
    if initial_state is None:
        S0 = q.new_zeros(B, H, K, V)  # [B, H, K, V]
    else:
        S0 = initial_state["S"]
        if tuple(S0.shape) != (B, H, K, V):
            raise ValueError(f"initial_state['S'] must be [B, H, K, V] = [{B}, {H}, {K}, {V}]; got {list(S0.shape)}")
    return q, k, a, b, w, S0


def naive_dplr(
    q: torch.Tensor,  # [B, H, T, K]
    k: torch.Tensor,  # [B, H, T, K]
    v: torch.Tensor,  # [B, H, T, V]
    a: torch.Tensor,  # [B, H, T, K]
    b: torch.Tensor,  # [B, H, T, K]
    w: torch.Tensor,  # [B, H, T, K] log-decay <= 0
    *,
    initial_state: State | None = None,
    chunk_size: int = DEFAULT_CHUNK,  # unused: same signature as every form
    scale: float = 1.0,
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    """The recurrence as written, with the transition matrix diag(exp w_t) + b_t a_t^T built explicitly (K x K per
    step): slow on purpose, it shares no algebra with the fast forms. Run it in float64."""
    q, k, a, b, w, S = _prologue(q, k, v, a, b, w, initial_state, scale, lengths)
    outs = []
    for t in range(q.shape[2]):
        transition = torch.diag_embed(w[:, :, t].exp()) + b[:, :, t, :, None] * a[:, :, t, None, :]  # [B, H, K, K]
        S = transition @ S + k[:, :, t, :, None] * v[:, :, t, None, :]  # [B, H, K, V]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # [B, H, V]
    if not outs:
        raise ValueError("naive_dplr needs at least one token")
    return torch.stack(outs, dim=2), {"S": S}  # [B, H, T, V]


def dplr_step(
    q: torch.Tensor,  # [B, H, 1, K]
    k: torch.Tensor,  # [B, H, 1, K]
    v: torch.Tensor,  # [B, H, 1, V]
    a: torch.Tensor,  # [B, H, 1, K]
    b: torch.Tensor,  # [B, H, 1, K]
    w: torch.Tensor,  # [B, H, 1, K] log-decay <= 0
    *,
    initial_state: State | None = None,
    chunk_size: int = DEFAULT_CHUNK,  # unused: same signature as every form
    scale: float = 1.0,
    lengths: torch.Tensor | None = None,  # refused: one token per row
) -> tuple[torch.Tensor, State]:
    """Exactly one token: the decode graph. Every tensor keeps its token axis and the products are MatMuls over
    [B, H, 1, .]:  u = a S [B, H, 1, V],  S' = exp(w)^T * S + b^T u + k^T v,  o = q S'."""
    if q.shape[2] != 1:
        raise ValueError(f"dplr_step takes one token, got a sequence of {q.shape[2]}")
    if lengths is not None:
        raise ValueError("dplr_step takes one token per row: no lengths")
    q, k, a, b, w, S = _prologue(q, k, v, a, b, w, initial_state, scale, None)
    u = a @ S  # [B, H, 1, V]: what a reads from the state before this step's decay
    S = w.exp().transpose(-1, -2) * S + b.transpose(-1, -2) @ u + k.transpose(-1, -2) @ v  # [B, H, K, V]
    return q @ S, {"S": S}  # [B, H, 1, V]


def recurrent_dplr(
    q, k, v, a, b, w, *, initial_state=None, chunk_size=DEFAULT_CHUNK, scale=1.0, lengths=None
) -> tuple[torch.Tensor, State]:
    """Any length, by ``dplr_step`` token by token (the decode path, run over a sequence)."""
    if lengths is not None:
        raise ValueError("recurrent_dplr does not take lengths; use the naive or chunk form for a ragged batch")
    state, outs = initial_state, []
    for t in range(q.shape[2]):
        one = slice(t, t + 1)
        o, state = dplr_step(*(x[:, :, one] for x in (q, k, v, a, b, w)), initial_state=state, scale=scale)
        outs.append(o)
    if not outs:
        raise ValueError("recurrent_dplr needs at least one token")
    return torch.cat(outs, dim=2), state  # [B, H, T, V]


def chunk_dplr(
    q: torch.Tensor,  # [B, H, T, K]
    k: torch.Tensor,  # [B, H, T, K]
    v: torch.Tensor,  # [B, H, T, V]
    a: torch.Tensor,  # [B, H, T, K]
    b: torch.Tensor,  # [B, H, T, K]
    w: torch.Tensor,  # [B, H, T, K] log-decay <= 0
    *,
    initial_state: State | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    scale: float = 1.0,
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    """The chunked WY form: per chunk of C tokens, everything is a masked product or a MatMul.

    Inside a chunk starting from the state S (positions i, j; c_i = sum_{s <= i} w_s per channel from the chunk
    start, c_{-1} = 0; u_i = S_{i-1}^T a_i [V], what a reads):
        S_i = diag(e^{c_i}) S + sum_{j <= i} diag(e^{c_i - c_j}) (b_j u_j^T + k_j v_j^T)
        u_i = S^T (a_i e^{c_{i-1}}) + sum_{j < i} (a_i^T diag(e^{c_{i-1} - c_j}) b_j) u_j + (... k_j) v_j
        (I - M_ab) U = Ae S + M_ak V       M_xy[i, j] = sum_K x_i y_j e^{c_{i-1} - c_j} for j < i, 0 otherwise
        T = (I - M_ab)^-1 (``unit_lower_inverse`` of -M_ab),  W = T Ae,  U0 = T M_ak V,  U = W S + U0
        O = (Qe + P_qb W) S + P_qb U0 + P_qk V      P_xy[i, j] = sum_K x_i y_j e^{c_i - c_j} for j <= i,  Qe = Q e^c
        S' = A S + Bm,   A = diag(e^{c_last}) + Bd^T W,   Bm = Bd^T U0 + Kd^T V,   Bd = B e^{c_last - c},  Kd = K e^{c_last - c}
    Every chunk is an affine map of the state it starts from; ``chunk_states`` scans them (no loop over tokens,
    none over chunks in the graph), then O for all chunks at once. The relative decays c_i - c_j and c_{i-1} - c_j
    are window sums over their own steps (``relative_log_decay``, [B, H, n, C, C, K]), -inf outside their window
    before the exp: no exp of a positive number and no division by a decay, so strong decays (w = -30 per step)
    underflow to exact zeros instead of overflowing. The sequence is zero-padded to a multiple of C with
    w = a = b = k = 0: padded steps are identity maps.

    Accuracy relative to the float64 naive form (scripts/dplr_accuracy.py; docs/DESIGN.md has the table), K = V = 64,
    C = 16, T up to 4000, from a carried state: RWKV-7's rank-one part (a = -kk, b = kk * lr) with no, mild or strong
    decays: float64 <= 5.1e-15, float32 <= 5.6e-7 (o and S; the recurrent form alike). A random rank-one part without
    decay (expanding transitions, the state grows with T): float64 2.4e-14, float32 3.1e-6, the recurrent form 2.4e-6.
    """
    q, k, a, b, w, S0 = _prologue(q, k, v, a, b, w, initial_state, scale, lengths)
    B, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    qc, kc, ac, bc, wc = (F.pad(x, (0, 0, 0, pad)).reshape(B, H, n, C, K) for x in (q, k, a, b, w))  # [B, H, n, C, K]
    vc = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, C, V)  # [B, H, n, C, V]

    decay = relative_log_decay(wc, dim=3).exp()  # [B, H, n, C(i), C(j), K]: e^{c_i - c_j} for j <= i, 0 above
    ec = wc.cumsum(3).exp()  # [B, H, n, C, K]: e^{c_i}
    ec_before = torch.cat([torch.ones_like(ec[..., :1, :]), ec[..., :-1, :]], dim=-2)  # [B, H, n, C, K]: e^{c_{i-1}}
    last = decay[..., -1, :, :]  # [B, H, n, C, K]: e^{c_last - c_j}

    qd = qc[..., :, None, :] * decay  # [B, H, n, C, C, K]: q_i e^{c_i - c_j}
    P_qk = (qd * kc[..., None, :, :]).sum(-1)  # [B, H, n, C, C]
    P_qb = (qd * bc[..., None, :, :]).sum(-1)  # [B, H, n, C, C]
    # M_xy's row i is row i - 1 of the same window (e^{c_{i-1} - c_j}, j <= i - 1) with a_i: pair a_{i+1} with row i,
    # then move the [C, C] products down one row (row 0 reads nothing before the chunk). Shifting a and the small
    # products, not the [C, C, K] decays, saves two passes over the largest tensors (~30 % of the graph's time).
    a_next = torch.cat([ac[..., 1:, :], torch.zeros_like(ac[..., :1, :])], dim=-2)  # [B, H, n, C, K]: a_{i+1}
    ad = a_next[..., :, None, :] * decay  # [B, H, n, C, C, K]: a_{i+1} e^{c_i - c_j}
    down = lambda X: torch.cat([torch.zeros_like(X[..., :1, :]), X[..., :-1, :]], dim=-2)  # noqa: E731  row i <- i - 1
    M_ab = down((ad * bc[..., None, :, :]).sum(-1))  # [B, H, n, C, C]: strictly lower
    M_ak = down((ad * kc[..., None, :, :]).sum(-1))  # [B, H, n, C, C]: strictly lower

    Tinv = unit_lower_inverse(-M_ab)  # [B, H, n, C, C]: (I - M_ab)^-1
    W = Tinv @ (ac * ec_before)  # [B, H, n, C, K]
    U0 = Tinv @ (M_ak @ vc)  # [B, H, n, C, V]
    Qe = qc * ec + P_qb @ W  # [B, H, n, C, K]
    O0 = P_qb @ U0 + P_qk @ vc  # [B, H, n, C, V]
    bdt = (bc * last).transpose(-1, -2)  # [B, H, n, K, C]
    kdt = (kc * last).transpose(-1, -2)  # [B, H, n, K, C]
    A = torch.diag_embed(ec[..., -1, :]) + bdt @ W  # [B, H, n, K, K]
    Bm = bdt @ U0 + kdt @ vc  # [B, H, n, K, V]
    starts, final = chunk_states(A, Bm, S0, scan_levels(n, C), tokens=T, chunk=C)  # [B, H, n, K, V], [B, H, K, V]
    o = Qe @ starts + O0  # [B, H, n, C, V]
    return o.reshape(B, H, n * C, V)[:, :, :T], {"S": final}  # [B, H, T, V]


DPLR_FORMS = {
    "naive": naive_dplr,
    "chunk": chunk_dplr,
    "recurrent": recurrent_dplr,
    "step": dplr_step,  # exactly one token: the decode graph
}
DPLR_SEQUENCE_FORMS = ("naive", "chunk", "recurrent")

__all__ = [
    "DEFAULT_CHUNK",
    "DPLR_FORMS",
    "DPLR_SEQUENCE_FORMS",
    "chunk_dplr",
    "dplr_state_layout",
    "dplr_step",
    "naive_dplr",
    "recurrent_dplr",
]
