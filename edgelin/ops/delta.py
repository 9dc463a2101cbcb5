"""The delta rule (DeltaNet), the gated delta rule (Gated DeltaNet, Kimi Delta Attention) and the delta product (Gated
DeltaProduct) in four forms with one signature:

    fn(q, k, v, beta, *, g=None, initial_state=None, chunk_size=64, scale=1.0, qk_l2norm=False, lengths=None)
        -> (o, final_state)

- ``naive_delta_rule``: the textbook recurrence with the K x K transition matrix; the reference (use float64).
- ``chunk_delta_rule``: the WY / UT-transform form, no loop over tokens; the prefill graph.
- ``recurrent_delta_rule`` / ``delta_step``: token by token; ``delta_step`` (exactly one token) is the decode graph.

The recurrence, per head, with the state S [K, V] (key-major, as edgelin's additive state S [F, Dv]):

    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,     o_t = scale * S_t^T q_t

alpha_t = exp(g_t) with g [B, H, T] a log-decay <= 0 per head per step (Gated DeltaNet); ``g=None`` is
DeltaNet (alpha = 1) and takes no decay ops at all. A g [B, H, T, K] decays each key channel (row of S) on its own
(Kimi Delta Attention), the decay before the delta update, as fla's KDA:

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T

beta [B, H, T] per head per step, in [0, 1] (sigmoid), or in [0, 2] when the model allows negative eigenvalues (the
caller doubles it; nothing here changes). With unit keys every factor (I - beta k k^T) has eigenvalues 1 and
1 - beta in [-1, 1]: the state cannot grow.

Inputs are [B, H, T, D] (edgelin's layout). q and k are used as given: the caller L2-normalises them (after its
short conv and activation), or passes ``qk_l2norm=True`` to have them normalised here as fla's kernels do,
x / sqrt(sum x^2 + 1e-6). ``scale`` multiplies q (fla and ONNX Runtime default to K^-0.5: pass it).

State (a dict, one per layer): "S" [B, H, K, V], key-major: ONNX Runtime's LinearAttention past state and fla's
ops (``initial_state``/``final_state``) use the same layout; fla's GatedDeltaNet layer caches it value-major
(``state_v_first=True``, [B, H, V, K]): convert either way with ``S.transpose(-1, -2)``.

``lengths`` ([B] int64, right padding; naive and chunk) makes a ragged batch: beta and g are set to 0 on the
padding, which makes each padded step the identity map (no write, no decay), so every row's final state is that
of its own tokens. The chunk form pads to a multiple of C the same way.

The chunk form's math, its matrix inverse with MatMuls only and its measured accuracy are in docs/DESIGN.md
("The delta rule") and in ``chunk_delta_rule``'s docstring.

The delta product (``DELTA_PRODUCT_FORMS``, fla's Gated DeltaProduct) takes n keys, values and betas per token,
k [B, H, T, n, K], v [B, H, T, n, V], beta [B, H, T, n], and one gate per token g [B, H, T]:

    S_t = exp(g_t) S_{t-1}, then for j = 1..n:  S_t = (I - beta_tj k_tj k_tj^T) S_t + beta_tj k_tj v_tj^T,   o_t = S_t^T q_t

Its fast forms are the delta rule over the T n interleaved steps (the gate on each token's first step, its query on
the last), with no new math; its naive form is a direct per-token loop of n explicit K x K factors.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from edgelin.ops import fused
from edgelin.ops.common import State, relative_log_decay
from edgelin.ops.lengths import padding_mask

L2NORM_EPS = 1e-6  # fla's l2norm epsilon: x / sqrt(sum x^2 + eps)
# The exported prefill graph cannot know the number of chunks n when it is built, so its scan across chunks
# runs a fixed number of levels, exact for n <= 2^levels chunks and NaN beyond (never silently wrong). An export
# bounds the tokens of one prefill call (``sequence_bound``: the manifest's ``max_sequence``; the runtimes cut
# longer prompts into pieces) and the scan gets just enough levels for it: log2(4096 / 64) = 6 at edgelin's
# default. Without a bound (a graph traced outside ``edgelin export``) it runs MAX_SCAN_LEVELS: 2^16 chunks, 4 M
# tokens at C = 64. Each level costs one K x K composition and ~30 small graph nodes per layer, and ~1 s of export
# per layer (a two-layer tiny model: 37 s to trace its prefill graph at 16 levels, 19 s at 4).
MAX_SCAN_LEVELS = 16
DEFAULT_MAX_SEQUENCE = 4096  # tokens per prefill call of an exported delta-rule graph, unless the export says otherwise


@dataclass
class SequenceBound:
    """The most tokens one call of the graph being traced takes (``tokens``); ``used`` turns True when a form
    built its graph to that bound (the export then records it in the manifest)."""

    tokens: int
    used: bool = False


_BOUNDS: list[SequenceBound] = []


@contextlib.contextmanager
def sequence_bound(tokens: int) -> Iterator[SequenceBound]:
    """While tracing an export: forms whose graph depends on the longest sequence it takes (the delta rule's
    scan across chunks) build it for ``tokens`` tokens per call."""
    bound = SequenceBound(int(tokens))
    _BOUNDS.append(bound)
    try:
        yield bound
    finally:
        _BOUNDS.remove(bound)


def delta_state_layout(*, n_heads: int, key_dim: int, value_dim: int) -> dict[str, tuple]:
    """name -> (shape with "batch" for the batch dim, dtype name, init value) of one delta-rule layer's state."""
    return {"S": (("batch", n_heads, key_dim, value_dim), "float32", 0.0)}


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + 1e-6) over the last axis (fla's formula)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm, lengths):
    """Checks shapes; returns (q scaled (and normalised), k, beta, g, S0) with beta and g zeroed on padding."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"q, k must be [B, H, T, K] and v [B, H, T, V] with the same B, H, T; got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}"
        )
    B, H, T, K = q.shape
    if beta is None or not beta.is_floating_point() or tuple(beta.shape) != (B, H, T):
        got = "None" if beta is None else f"{beta.dtype} {list(beta.shape)}"
        raise ValueError(f"beta must be a float tensor of shape [B, H, T] = [{B}, {H}, {T}]; got {got}")
    if g is not None and (not g.is_floating_point() or tuple(g.shape) not in ((B, H, T), (B, H, T, K))):
        raise ValueError(
            f"g (log-decay) must be a float tensor of shape [B, H, T] = [{B}, {H}, {T}] (per head) or [B, H, T, K] = "
            f"[{B}, {H}, {T}, {K}] (per key channel); got {g.dtype} {list(g.shape)}"
        )
    beta = beta.to(q.dtype)
    g = None if g is None else g.to(q.dtype)
    if lengths is not None:
        real = padding_mask(lengths, T)[:, None, :]  # [B, 1, T]
        beta = torch.where(real, beta, 0.0)  # [B, H, T]: a padded step writes nothing ...
        if g is not None:  # ... and forgets nothing
            g = torch.where(real if g.dim() == 3 else real[..., None], g, 0.0)  # [B, H, T] or [B, H, T, K]
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale != 1.0:
        q = q * scale
    if initial_state is None:
        S0 = q.new_zeros(B, H, K, v.shape[-1])  # [B, H, K, V]
    else:
        S0 = initial_state["S"]
        if tuple(S0.shape) != (B, H, K, v.shape[-1]):
            raise ValueError(f"initial_state['S'] must be [B, H, K, V] = [{B}, {H}, {K}, {v.shape[-1]}]; got {list(S0.shape)}")
    return q, k, beta, g, S0


def naive_delta_rule(
    q: torch.Tensor,  # [B, H, T, K]
    k: torch.Tensor,  # [B, H, T, K]
    v: torch.Tensor,  # [B, H, T, V]
    beta: torch.Tensor,  # [B, H, T]
    *,
    g: torch.Tensor | None = None,  # [B, H, T] or [B, H, T, K] log-decay <= 0; None: DeltaNet
    initial_state: State | None = None,
    chunk_size: int = 64,  # unused: same signature as every form
    scale: float = 1.0,
    qk_l2norm: bool = False,
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    """The recurrence as written, with the transition matrix alpha_t (I - beta_t k_t k_t^T) (per-channel g:
    (I - beta_t k_t k_t^T) diag(exp g_t)) built explicitly
    (K x K per step): slow on purpose, it shares no algebra with the fast forms. Run it in float64."""
    q, k, beta, g, S = _prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm, lengths)
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)  # [K, K]
    outs = []
    for t in range(q.shape[2]):
        kt, bt = k[:, :, t], beta[:, :, t, None, None]  # [B, H, K], [B, H, 1, 1]
        transition = eye - bt * kt[..., :, None] * kt[..., None, :]  # [B, H, K, K]
        if g is not None and g.dim() == 3:
            transition = g[:, :, t, None, None].exp() * transition  # [B, H, K, K]
        elif g is not None:  # per channel: decay first, then the delta update: (I - beta k k^T) diag(e^g)
            transition = transition * g[:, :, t, None, :].exp()  # [B, H, K, K]: column c scaled by e^{g_c}
        S = transition @ S + bt * kt[..., :, None] * v[:, :, t, None, :]  # [B, H, K, V]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # [B, H, V]
    return torch.stack(outs, dim=2), {"S": S}  # [B, H, T, V]


def delta_step(
    q: torch.Tensor,  # [B, H, 1, K]
    k: torch.Tensor,  # [B, H, 1, K]
    v: torch.Tensor,  # [B, H, 1, V]
    beta: torch.Tensor,  # [B, H, 1]
    *,
    g: torch.Tensor | None = None,  # [B, H, 1] or [B, H, 1, K] log-decay <= 0; None: DeltaNet
    initial_state: State | None = None,
    chunk_size: int = 64,  # unused: same signature as every form
    scale: float = 1.0,
    qk_l2norm: bool = False,
    lengths: torch.Tensor | None = None,  # refused: one token per row
) -> tuple[torch.Tensor, State]:
    """Exactly one token: the decode graph. As ``recurrent_step``, every tensor keeps its token axis and the
    products are MatMuls over [B, H, 1, .]:  S' = alpha S + k^T u,  u = beta (v - k (alpha S)),  o = q S'
    (alpha S: the rows of S scaled by exp(g) per channel, or all of S by exp(g) per head)."""
    if q.shape[2] != 1:
        raise ValueError(f"delta_step takes one token, got a sequence of {q.shape[2]}")
    if lengths is not None:
        raise ValueError("delta_step takes one token per row: no lengths")
    q, k, beta, g, S = _prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm, None)
    if fused.active():  # the fused lowering (edgelin.ops.fused)
        o, S = fused.delta(q, k, v, beta, g, S)
        return o, {"S": S}
    if g is not None:
        S = (g.exp()[..., None] if g.dim() == 3 else g.exp().transpose(-1, -2)) * S  # [B, H, 1 | K, 1] x [B, H, K, V]
    u = beta[..., None] * (v - k @ S)  # [B, H, 1, V]: what the state writes for this key
    S = S + k.transpose(-1, -2) * u  # [B, H, K, 1] x [B, H, 1, V] -> [B, H, K, V]
    return q @ S, {"S": S}  # [B, H, 1, V]


def recurrent_delta_rule(
    q, k, v, beta, *, g=None, initial_state=None, chunk_size=64, scale=1.0, qk_l2norm=False, lengths=None
) -> tuple[torch.Tensor, State]:
    """Any length, by ``delta_step`` token by token (the decode path, run over a sequence)."""
    if lengths is not None:
        raise ValueError("recurrent_delta_rule does not take lengths; use the naive or chunk form for a ragged batch")
    state, outs = initial_state, []
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        o, state = delta_step(
            q[:, :, step], k[:, :, step], v[:, :, step], beta[:, :, step], g=None if g is None else g[:, :, step],
            initial_state=state, scale=scale, qk_l2norm=qk_l2norm,
        )
        outs.append(o)
    if not outs:
        raise ValueError("recurrent_delta_rule needs at least one token")
    return torch.cat(outs, dim=2), state  # [B, H, T, V]


def unit_lower_inverse(M: torch.Tensor) -> torch.Tensor:
    """(I + M)^-1 for strictly lower-triangular M [..., C, C], by block forward substitution with MatMuls only.

    Doubling the block size s = 1, 2, 4, ...: with the inverses A^-1, D^-1 of two neighbouring diagonal blocks
    of size s known, the block of size 2s [[A, 0], [E, D]] has the inverse [[A^-1, 0], [-D^-1 E A^-1, D^-1]].
    log2(C) levels; every intermediate is a block of the true inverse (nothing grows that the result does not
    hold, unlike the product (I - M)(I + M^2)(I + M^4)..., whose factors hold powers of M); work ~C^3 / 3 per
    matrix. C is padded to a power of two with identity blocks (zeros in M).
    """
    C = M.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()  # the power of two >= C
    if P != C:
        M = F.pad(M, (0, P - C, 0, P - C))  # [..., P, P]
    lead = M.shape[:-2]
    X = torch.ones(*lead, P, 1, 1, dtype=M.dtype, device=M.device)  # [..., P blocks, 1, 1]: unit diagonal
    s = 1
    while s < P:
        pairs = P // (2 * s)
        below = M.reshape(*lead, pairs, 2 * s, pairs, 2 * s)[..., s:, :, :s]  # [..., pairs, s, pairs, s]
        E = torch.diagonal(below, dim1=-4, dim2=-2).permute(*range(len(lead)), -1, -3, -2)  # [..., pairs, s, s]
        Xp = X.reshape(*lead, pairs, 2, s, s)  # [..., pairs, 2, s, s]
        Ai, Di = Xp[..., 0, :, :], Xp[..., 1, :, :]  # [..., pairs, s, s]
        low = -(Di @ (E @ Ai))  # [..., pairs, s, s]
        top = torch.cat([Ai, torch.zeros_like(Ai)], dim=-1)  # [..., pairs, s, 2s]
        X = torch.cat([top, torch.cat([low, Di], dim=-1)], dim=-2)  # [..., pairs, 2s, 2s]
        s *= 2
    return X.reshape(*lead, P, P)[..., :C, :C]  # [..., C, C]


def scan_levels(n, chunk: int = 1, substeps: int = 1) -> int:
    """Levels of the scan across n chunks of ``chunk`` steps: exactly enough in eager mode. When n is symbolic
    (an export with a dynamic sequence length) one graph serves every length up to the ``sequence_bound`` in
    force (its tokens, ``substeps`` steps each, in chunks), or up to 2^MAX_SCAN_LEVELS chunks without one."""
    if isinstance(n, int):
        return max(n - 1, 0).bit_length()
    if not _BOUNDS:
        return MAX_SCAN_LEVELS
    _BOUNDS[-1].used = True
    return scan_levels(-(-_BOUNDS[-1].tokens * substeps // chunk))


def chunk_states(
    A: torch.Tensor, Bm: torch.Tensor, S0: torch.Tensor, levels: int, tokens=None, chunk: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The state before each chunk and after the last, for the affine chunk maps S -> A_i S + B_i.

    A [..., n, K, K], Bm [..., n, K, V], S0 [..., K, V] -> ([..., n, K, V], [..., K, V]). A work-efficient
    (Blelloch) scan with ``levels`` static levels and no data-dependent count, so one graph serves any
    n <= 2^levels. Up: level l + 1 holds the ceil(n / 2^(l+1)) compositions of neighbouring pairs of level l
    (an odd count is completed by one identity map). Down: the state at the start of each pair is its first
    member's start, and through the first member's map its second member's. ~n compositions (K^3 + K^2 V
    each) and ~n applications (K^2 V) in all: linear in n.

    Written for torch.export with a symbolic n: every level is gathered with index vectors (Range, Gather)
    from an array one longer than the last, never sliced or reshaped to a length that depends on the level
    below (that made torch.export specialise the sequence length: its guards on nested floor divisions of n
    could not be proved, and torch.onnx then exported a graph for the example length only).
    """
    K = A.shape[-1]
    lead = A.shape[:-3]
    eye = torch.eye(K, dtype=A.dtype, device=A.device).expand(*lead, 1, K, K)  # [..., 1, K, K]
    zero = torch.zeros_like(Bm[..., :1, :, :])  # [..., 1, K, V]
    if tokens is None:
        tokens = A.shape[-3]  # n maps of one token each
    # blocks at level l: ceil(n / 2^l), written from the token count (one floor division, not nested ones:
    # torch.export's symbolic shapes cost far less to trace with them)
    count = lambda level: (tokens + (chunk << level) - 1) // (chunk << level)  # noqa: E731
    firsts = []
    for level in range(levels):
        pairs = torch.arange(count(level + 1), device=A.device)  # [ceil(n / 2^(l+1))]
        A1 = torch.cat([A, eye], dim=-3)  # [..., m + 1, K, K]: the identity completes an odd count
        B1 = torch.cat([Bm, zero], dim=-3)  # [..., m + 1, K, V]
        first, second = 2 * pairs, 2 * pairs + 1  # [pairs]
        Af, As = A1.index_select(-3, first), A1.index_select(-3, second)  # [..., pairs, K, K]
        Bf, Bs = B1.index_select(-3, first), B1.index_select(-3, second)  # [..., pairs, K, V]
        firsts.append((Af, Bf, count(level)))
        A, Bm = As @ Af, As @ Bf + Bs  # [..., pairs, K, K], [..., pairs, K, V]: second after first
    top = torch.zeros(1, dtype=torch.int64, device=A.device)  # [1]: the one block left (n <= 2^levels)
    A_top, B_top = A.index_select(-3, top)[..., 0, :, :], Bm.index_select(-3, top)[..., 0, :, :]  # [..., K, K], [..., K, V]
    final = A_top @ S0 + B_top  # [..., K, V]
    # The top block's start, gathered to the top level's count (1) as written from n: in an export n is
    # symbolic, and a static 1 against it would make torch.export guard on (and specialise) the length.
    blocks = torch.zeros(count(levels), dtype=torch.int64, device=A.device)  # [1]
    starts = S0[..., None, :, :].index_select(-3, blocks)  # [..., 1, K, V]
    # More than 2^levels chunks leave more than one top block, and the result would be wrong: make it NaN.
    spill = (blocks + 1).sum() > 1  # []: False for n <= 2^levels
    starts, final = torch.where(spill, float("nan"), starts), torch.where(spill, float("nan"), final)
    for Af, Bf, m in reversed(firsts):
        through = Af @ starts + Bf  # [..., pairs, K, V]: the start of each pair's second member
        starts = torch.stack([starts, through], dim=-3)  # [..., pairs, 2, K, V]
        starts = starts.reshape(*lead, -1, *starts.shape[-2:])  # [..., 2 pairs, K, V]: first, second, first, ...
        starts = starts.index_select(-3, torch.arange(m, device=A.device))  # [..., m, K, V]: less the padding
    return starts, final


def chunk_delta_rule(
    q: torch.Tensor,  # [B, H, T, K]
    k: torch.Tensor,  # [B, H, T, K]
    v: torch.Tensor,  # [B, H, T, V]
    beta: torch.Tensor,  # [B, H, T]
    *,
    g: torch.Tensor | None = None,  # [B, H, T] or [B, H, T, K] log-decay <= 0; None: DeltaNet
    initial_state: State | None = None,
    chunk_size: int = 64,
    scale: float = 1.0,
    qk_l2norm: bool = False,
    lengths: torch.Tensor | None = None,  # [B] int64 real tokens per row (right padding); None: all T
) -> tuple[torch.Tensor, State]:
    """The WY / UT-transform form: per chunk of C tokens, everything is a masked product or a MatMul.

    Inside a chunk (positions i, j; b_i = sum_{s <= i} g_s from the chunk start; Gamma_ij = exp(L_ij),
    L_ij = sum_{j < s <= i} g_s, -inf above the diagonal before the exp: ``relative_log_decay``):
        u_i = beta_i (v_i - k_i^T (alpha_i S_{i-1}))   (the delta the state writes:  S_i = alpha_i S_{i-1} + k_i u_i^T)
        (I + M) U = beta V - (beta e^b K) S,     M = strict_tril(diag(beta) K K^T * Gamma)
        T = (I + M)^-1 (``unit_lower_inverse``),  U0 = T (beta V),  W = T (beta e^b K),  U = U0 - W S
        O = (Q e^b) S + tril(Q K^T * Gamma) U = Qe S + O0,   Qe = Q e^b - P W,  O0 = P U0,  P = tril(Q K^T * Gamma)
        S' = e^{b_C} S + (K e^{b_C - b})^T U = A S + Bm,   A = e^{b_C} I - Kd^T W,  Bm = Kd^T U0,  Kd = K e^{b_C - b}
    Every chunk is an affine map of the state S it starts from; ``chunk_states`` scans them (no loop over
    tokens, none over chunks in the graph), then O = Qe S_start + O0 for all chunks at once. No exp of a
    positive number for g <= 0 and no division by a decay, so strong gates (g = -20 per step) underflow to
    exact zeros instead of overflowing. The sequence is zero-padded to a multiple of C with beta = g = 0:
    padded steps are identity maps.

    Accuracy, relative to the float64 naive form (scripts/delta_accuracy.py; docs/DESIGN.md has the table),
    worst over DeltaNet / Gated DeltaNet, beta near 0, uniform, near 1 and in (1, 2), T up to 2000, C = 64:
    float64 9e-15 (o) / 2.6e-14 (S) at K = V = 64, 1.3e-14 / 1.7e-14 at 128; float32 7.1e-7 / 6.7e-7 at 64,
    6.2e-7 / 8.2e-7 at 128 (the recurrent form: 8.7e-7 / 1.5e-6). Adversarial: one key repeated with beta = 2
    (a reflection, nothing decays), float32 7e-6 (the recurrent form 3e-6).

    A per-channel g [B, H, T, K] (Kimi Delta Attention: S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} +
    beta_t k_t v_t^T, the decay first) takes the same steps with the decays per channel c: b_ic the in-chunk
    cumulative log-decay, Gamma_ijc = exp(L_ijc) from the masked window sums [.., C, C, K] (``relative_log_decay``),
        M_ij = beta_i sum_c k_ic k_jc Gamma_ijc (j < i),   P_ij = sum_c q_ic k_jc Gamma_ijc (j <= i),
        W = T (beta e^b * K),  Qe = Q * e^b - P W,  Kd_j = k_j * Gamma_{C-1, j},  A = diag(e^{b_C}) - Kd^T W
    The [.., C, C, K] decays cost T C K elements per head: use a smaller chunk (edgelin's KDA import: C = 32).
    """
    q, k, beta, g, S0 = _prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm, lengths)
    if fused.active() and lengths is None:  # the fused lowering (edgelin.ops.fused); a ragged batch stays portable
        o, S = fused.delta(q, k, v, beta, g, S0)
        return o, {"S": S}
    o, final = _chunk_core(q, k, v, beta, g, S0, chunk_size)
    return o, {"S": final}


def _chunk_core(q, k, v, beta, g, S0, chunk_size: int, substeps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_delta_rule`` after its prologue: q (scaled), k [B, H, T, K], v [B, H, T, V], beta [B, H, T], g [B, H, T]
    or [B, H, T, K] or None, S0 [B, H, K, V] -> (o [B, H, T, V], final S [B, H, K, V]). ``substeps``: steps per
    token of the caller's sequence (the scan's levels under an export's ``sequence_bound`` count steps)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    qc = F.pad(q, (0, 0, 0, pad)).reshape(B, H, n, C, K)  # [B, H, n, C, K]
    kc = F.pad(k, (0, 0, 0, pad)).reshape(B, H, n, C, K)  # [B, H, n, C, K]
    vc = F.pad(v, (0, 0, 0, pad)).reshape(B, H, n, C, V)  # [B, H, n, C, V]
    bc = F.pad(beta, (0, pad)).reshape(B, H, n, C, 1)  # [B, H, n, C, 1]

    ones = torch.ones(C, C, dtype=torch.bool, device=q.device)
    causal, strict = ones.tril(), ones.tril(-1)  # [C, C]
    qk = qc @ kc.transpose(-1, -2)  # [B, H, n, C, C]
    kk = kc @ kc.transpose(-1, -2)  # [B, H, n, C, C]
    if g is None:
        M = torch.where(strict, bc * kk, 0.0)  # [B, H, n, C, C]
        P = torch.where(causal, qk, 0.0)  # [B, H, n, C, C]
        kb_decayed, qe, kd = bc * kc, qc, kc  # [B, H, n, C, K]
    elif g.dim() == 4:  # per channel
        gc = F.pad(g, (0, 0, 0, pad)).reshape(B, H, n, C, K)  # [B, H, n, C, K]
        decay = relative_log_decay(gc, dim=3).exp()  # [B, H, n, C, C, K]: Gamma per channel, 0 above the diagonal
        eb = gc.cumsum(3).exp()  # [B, H, n, C, K]: e^{b_i}
        kj = kc[..., None, :, :]  # [B, H, n, 1, C, K]: key j
        M = torch.where(strict, bc * (kc[..., :, None, :] * kj * decay).sum(-1), 0.0)  # [B, H, n, C, C]
        P = (qc[..., :, None, :] * kj * decay).sum(-1)  # [B, H, n, C, C]: causal already
        kb_decayed, qe, kd = bc * eb * kc, eb * qc, decay[..., -1, :, :] * kc  # [B, H, n, C, K]
    else:
        gc = F.pad(g, (0, pad)).reshape(B, H, n, C)  # [B, H, n, C]
        decay = relative_log_decay(gc, dim=3).exp()  # [B, H, n, C, C]: Gamma, 0 above the diagonal
        eb = gc.cumsum(3).exp()[..., None]  # [B, H, n, C, 1]: e^{b_i}, from the chunk start through step i
        M = torch.where(strict, bc * kk * decay, 0.0)  # [B, H, n, C, C]
        P = qk * decay  # [B, H, n, C, C]: causal already (Gamma is 0 above the diagonal)
        kb_decayed, qe, kd = bc * eb * kc, eb * qc, decay[..., -1, :, None] * kc  # [B, H, n, C, K]
    Tinv = unit_lower_inverse(M)  # [B, H, n, C, C]
    U0 = Tinv @ (bc * vc)  # [B, H, n, C, V]
    W = Tinv @ kb_decayed  # [B, H, n, C, K]
    Qe = qe - P @ W  # [B, H, n, C, K]
    O0 = P @ U0  # [B, H, n, C, V]
    kdt = kd.transpose(-1, -2)  # [B, H, n, K, C]
    eye = torch.eye(K, dtype=q.dtype, device=q.device)  # [K, K]
    # e^{b_C} I: eb [B, H, n, C, 1] per head, [B, H, n, C, K] per channel (the diagonal)
    A = (eye if g is None else eb[..., -1, :, None] * eye) - kdt @ W  # [B, H, n, K, K]
    Bm = kdt @ U0  # [B, H, n, K, V]
    levels = scan_levels(n, C, substeps)
    starts, final = chunk_states(A, Bm, S0, levels, tokens=T, chunk=C)  # [B, H, n, K, V], [B, H, K, V]
    o = Qe @ starts + O0  # [B, H, n, C, V]
    return o.reshape(B, H, n * C, V)[:, :, :T], final  # [B, H, T, V]


# ---- the delta product (Gated DeltaProduct): n Householder steps per token, one gate per token ----------------------


def _product_prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm):
    """Checks shapes; returns (q scaled (and normalised) [B, H, T, K], k (normalised) [B, H, T, n, K], beta, g, S0)."""
    if q.dim() != 4 or k.dim() != 5 or k.shape[:3] != q.shape[:3] or k.shape[-1] != q.shape[-1] or v.dim() != 5 \
            or v.shape[:4] != k.shape[:4]:
        raise ValueError(
            f"q must be [B, H, T, K], k [B, H, T, n, K] and v [B, H, T, n, V] with the same B, H, T, n; got q "
            f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    B, H, T, n, K = k.shape
    if not beta.is_floating_point() or tuple(beta.shape) != (B, H, T, n):
        raise ValueError(
            f"beta must be a float tensor of shape [B, H, T, n] = [{B}, {H}, {T}, {n}]; got {beta.dtype} {list(beta.shape)}"
        )
    if g is not None and (not g.is_floating_point() or tuple(g.shape) != (B, H, T)):
        raise ValueError(
            f"g (log-decay) must be a float tensor of shape [B, H, T] = [{B}, {H}, {T}]; got {g.dtype} {list(g.shape)}"
        )
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale != 1.0:
        q = q * scale
    S0 = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state["S"]
    if tuple(S0.shape) != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state['S'] must be [B, H, K, V] = [{B}, {H}, {K}, {v.shape[-1]}]; got {list(S0.shape)}")
    return q, k, beta.to(q.dtype), None if g is None else g.to(q.dtype), S0


def _interleave(q, k, v, beta, g):
    """The product as the delta rule over T n steps: token t's steps t n ... t n + n - 1 take its keys, values and
    betas in order, its gate on the first (0 on the others: no decay) and its query on the last (0 on the others).
    -> (q, k [B, H, T n, K], v [B, H, T n, V], beta [B, H, T n], g [B, H, T n] or None)."""
    B, H, T, n, K = k.shape
    steps = lambda x: x.reshape(B, H, -1, *x.shape[4:])  # noqa: E731  [B, H, T, n, ...] -> [B, H, T n, ...]
    qs = steps(F.pad(q[:, :, :, None, :], (0, 0, n - 1, 0)))  # [B, H, T n, K]
    gs = None if g is None else steps(F.pad(g[..., None], (0, n - 1)))  # [B, H, T n]
    return qs, steps(k), steps(v), steps(beta), gs


def naive_delta_product(
    q: torch.Tensor,  # [B, H, T, K]
    k: torch.Tensor,  # [B, H, T, n, K]
    v: torch.Tensor,  # [B, H, T, n, V]
    beta: torch.Tensor,  # [B, H, T, n]
    *,
    g: torch.Tensor | None = None,  # [B, H, T] log-decay <= 0 per token; None: no gate (DeltaProduct)
    initial_state: State | None = None,
    chunk_size: int = 64,  # unused: same signature as every form
    scale: float = 1.0,
    qk_l2norm: bool = False,
) -> tuple[torch.Tensor, State]:
    """The delta product as written: per token, S_t = H_n ... H_1 (exp(g_t) S_{t-1}) + the writes, each Householder-like
    factor (I - beta_j k_j k_j^T) built explicitly (K x K) with its write beta_j k_j v_j^T after it, o_t = S_t^T q_t.
    Slow on purpose and shares no code with the fast forms (they run the delta rule over the interleaved steps).
    Run it in float64."""
    q, k, beta, g, S = _product_prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm)
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)  # [K, K]
    outs = []
    for t in range(q.shape[2]):
        if g is not None:
            S = g[:, :, t, None, None].exp() * S  # [B, H, K, V]
        for j in range(k.shape[3]):
            kj, bj = k[:, :, t, j], beta[:, :, t, j, None, None]  # [B, H, K], [B, H, 1, 1]
            factor = eye - bj * kj[..., :, None] * kj[..., None, :]  # [B, H, K, K]
            S = factor @ S + bj * kj[..., :, None] * v[:, :, t, j, None, :]  # [B, H, K, V]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))  # [B, H, V]
    return torch.stack(outs, dim=2), {"S": S}  # [B, H, T, V]


def chunk_delta_product(
    q, k, v, beta, *, g=None, initial_state=None, chunk_size=64, scale=1.0, qk_l2norm=False
) -> tuple[torch.Tensor, State]:
    """The delta product by the delta rule's chunk form over the T n interleaved steps (``_interleave``; C steps a
    chunk), each token's output read at its last step. The fused lowering runs the same steps through one node."""
    q, k, beta, g, S0 = _product_prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm)
    B, H, T, n, K = k.shape
    qs, ks, vs, bs, gs = _interleave(q, k, v, beta, g)
    if fused.active():
        o, S = fused.delta(qs, ks, vs, bs, gs, S0)  # [B, H, T n, V]
    else:
        o, S = _chunk_core(qs, ks, vs, bs, gs, S0, chunk_size, substeps=n)  # [B, H, T n, V]
    return o.reshape(B, H, T, n, -1)[:, :, :, -1], {"S": S}  # [B, H, T, V]


def delta_product_step(
    q, k, v, beta, *, g=None, initial_state=None, chunk_size=64, scale=1.0, qk_l2norm=False
) -> tuple[torch.Tensor, State]:
    """Exactly one token (the decode graph): the gate, then the n steps of ``delta_step``'s update unrolled (n is a
    fixed size of the layer: no loop in the graph), then o = q S."""
    if q.shape[2] != 1:
        raise ValueError(f"delta_product_step takes one token, got a sequence of {q.shape[2]}")
    q, k, beta, g, S = _product_prologue(q, k, v, beta, g, initial_state, scale, qk_l2norm)
    n = k.shape[3]
    if fused.active():
        qs, ks, vs, bs, gs = _interleave(q, k, v, beta, g)
        o, S = fused.delta(qs, ks, vs, bs, gs, S)  # [B, H, n, V]
        return o[:, :, -1:], {"S": S}
    if g is not None:
        S = g.exp()[..., None] * S  # [B, H, 1, 1] x [B, H, K, V]
    for j in range(n):
        kj = k[:, :, :, j]  # [B, H, 1, K]
        u = beta[:, :, :, j, None] * (v[:, :, :, j] - kj @ S)  # [B, H, 1, V]
        S = S + kj.transpose(-1, -2) * u  # [B, H, K, V]
    return q @ S, {"S": S}  # [B, H, 1, V]


def recurrent_delta_product(
    q, k, v, beta, *, g=None, initial_state=None, chunk_size=64, scale=1.0, qk_l2norm=False
) -> tuple[torch.Tensor, State]:
    """Any length, by ``delta_product_step`` token by token."""
    state, outs = initial_state, []
    for t in range(q.shape[2]):
        step = slice(t, t + 1)
        o, state = delta_product_step(
            q[:, :, step], k[:, :, step], v[:, :, step], beta[:, :, step], g=None if g is None else g[:, :, step],
            initial_state=state, scale=scale, qk_l2norm=qk_l2norm,
        )
        outs.append(o)
    if not outs:
        raise ValueError("recurrent_delta_product needs at least one token")
    return torch.cat(outs, dim=2), state  # [B, H, T, V]


DELTA_PRODUCT_FORMS = {
    "naive": naive_delta_product,
    "chunk": chunk_delta_product,
    "recurrent": recurrent_delta_product,
    "step": delta_product_step,  # exactly one token: the decode graph
}


DELTA_FORMS = {
    "naive": naive_delta_rule,
    "chunk": chunk_delta_rule,
    "recurrent": recurrent_delta_rule,
    "step": delta_step,  # exactly one token: the decode graph
}
DELTA_SEQUENCE_FORMS = ("naive", "chunk", "recurrent")

__all__ = [
    "DELTA_FORMS",
    "DELTA_PRODUCT_FORMS",
    "DELTA_SEQUENCE_FORMS",
    "DEFAULT_MAX_SEQUENCE",
    "MAX_SCAN_LEVELS",
    "SequenceBound",
    "chunk_delta_product",
    "chunk_delta_rule",
    "chunk_states",
    "delta_state_layout",
    "delta_product_step",
    "delta_step",
    "l2norm",
    "naive_delta_product",
    "naive_delta_rule",
    "recurrent_delta_product",
    "recurrent_delta_rule",
    "scan_levels",
    "sequence_bound",
    "unit_lower_inverse",
]
