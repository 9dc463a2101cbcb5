"""A diagonal linear recurrence (one decay per channel and step), in several forms with one signature:

    h_t = a_t * h_{t-1} + u_t,     a_t = exp(g_t), g_t <= 0        (elementwise over D channels)

    fn(g [B, T, D], u [B, T, D], h0 [B, D], *, chunk_size) -> (h [B, T, D], h_T [B, D])

- ``naive_diagonal_scan``: the definition, one token at a time (the reference; run it in float64).
- ``chunk_diagonal_scan``: parallel over time with no loop over tokens and no Loop/Scan node, for any T (a dynamic
  axis in the graph).
- ``blocked_diagonal_scan``: the prefill graph's form ("chunk" in ``DIAGONAL_FORMS``): blocks of 8 steps stepped
  through together, then ``chunk_diagonal_scan`` over the blocks; the same sums in fewer passes over memory.
- ``step_diagonal_scan``: exactly one token (the decode graph).

``chunk_diagonal_scan`` cuts the sequence into n chunks of C steps (zero-padded: g = 0 and u = 0 change nothing).
Within a chunk, a log-depth (Hillis-Steele) scan of the pairs (a, u): ceil(log2 C) rounds of

    h_t <- h_t + A_t h_{t-d},   A_t <- A_t A_{t-d}       (d = 1, 2, 4, ...; h_{t-d} = 0, A_{t-d} = 1 before the start)

leave h_t = the chunk-local state from zero and A_t = the product of a over the chunk's first t + 1 steps: only
products of decays in (0, 1], O(T D) memory and work per round (a C x C decay matrix per channel would be T C D).
Across chunks, the state each chunk starts from is a chunk-level decay matrix over the chunk totals c_m (the
window sums of g of chunk m), with the initial state as item 0 (``relative_log_decay``: masked window sums, -inf
above the diagonal before the exp, so never the exp of a positive number):

    [H_0, H_1, ..., H_n] = exp(L') @ [h0, E_0, ..., E_{n-1}],   L' = relative_log_decay([0, c_0, ..., c_{n-1}])

(E_m: chunk m's local end state) and h = local + A * H_{chunk}. The chunk-level part is [n + 1, n + 1, D] per row:
quadratic in the number of chunks, as the linear-attention chunk form's (edgelin.ops.chunk); the runtime prefills
long prompts in pieces of a few thousand tokens, which bounds n (run over the blocks of ``blocked_diagonal_scan``,
n = T / (8 C): 9 x 9 x D per row for a piece of 4,096 tokens at C = 64).

Under the fused lowering (``edgelin export --ops fused``) the chunk and step forms are one
``com.microsoft.LinearAttention`` node (``fused_diagonal_scan``): the recurrence is the node's "gated" rule with one
head per channel, d_k = d_v = 1, q = k = 1, v = u and the per-head log-decay g, so that o_t = S_t = h_t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgelin.ops import fused
from edgelin.ops.common import relative_log_decay


def naive_diagonal_scan(g: torch.Tensor, u: torch.Tensor, h0: torch.Tensor, *, chunk_size: int | None = None):
    """h_t = exp(g_t) h_{t-1} + u_t, token by token: g, u [B, T, D], h0 [B, D] -> h [B, T, D], h_T [B, D]."""
    h, out = h0, []
    for t in range(u.shape[1]):
        h = g[:, t].exp() * h + u[:, t]
        out.append(h)
    return torch.stack(out, dim=1), h


def step_diagonal_scan(g: torch.Tensor, u: torch.Tensor, h0: torch.Tensor, *, chunk_size: int | None = None):
    """One token: g, u [B, 1, D], h0 [B, D] -> h [B, 1, D], h [B, D]."""
    h = g[:, 0].exp() * h0 + u[:, 0]  # [B, D]
    return h[:, None], h


def _shift(x: torch.Tensor, d: int, fill: float) -> torch.Tensor:
    """x [B, n, C, D] moved d steps later along the chunk axis, ``fill`` in the first d."""
    return F.pad(x[:, :, : x.shape[2] - d], (0, 0, d, 0), value=fill)


def chunk_diagonal_scan(g: torch.Tensor, u: torch.Tensor, h0: torch.Tensor, *, chunk_size: int = 64):
    """The chunked parallel form (module docstring): g, u [B, T, D], h0 [B, D] -> h [B, T, D], h_T [B, D]."""
    B, T, D = u.shape
    C = chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    gc = F.pad(g, (0, 0, 0, pad)).reshape(B, n, C, D)  # [B, n, C, D]: padded steps do not decay
    h = F.pad(u, (0, 0, 0, pad)).reshape(B, n, C, D)  # [B, n, C, D]: and add nothing
    A = gc.exp()  # [B, n, C, D], in (0, 1]
    d = 1
    while d < C:  # a fixed number of rounds for the chunk length: unrolled in the graph
        h = h + A * _shift(h, d, 0.0)
        A = A * _shift(A, d, 1.0)
        d *= 2
    totals = torch.cat([torch.zeros_like(gc[:, :1, 0]), gc.sum(2)], dim=1)  # [B, n + 1, D]: 0, then each chunk's log-decay
    items = torch.cat([h0[:, None], h[:, :, -1]], dim=1)  # [B, n + 1, D]: h0, then each chunk's local end state
    across = relative_log_decay(totals, dim=1).exp()  # [B, n + 1, n + 1, D]
    starts = (across * items[:, None]).sum(2)  # [B, n + 1, D]: the state before chunk m, and after the last
    h = h + A * starts[:, :-1, None]  # [B, n, C, D]
    return h.reshape(B, n * C, D)[:, :T], starts[:, -1]


def fused_diagonal_scan(g: torch.Tensor, u: torch.Tensor, h0: torch.Tensor, *, chunk_size: int | None = None):
    """Any T through one LinearAttention node (module docstring): g, u [B, T, D], h0 [B, D] -> h [B, T, D], h_T [B, D]."""
    B, T, D = u.shape
    ones = torch.ones_like(u)  # q and k: [B, T, D heads x 1]
    h, S = fused.linear_attention_op(ones, ones, u, h0.reshape(B, D, 1, 1), g, None, "gated", D, 1.0)  # [B, T, D], [B, D, 1, 1]
    return h, S.reshape(B, D)


def blocked_diagonal_scan(g: torch.Tensor, u: torch.Tensor, h0: torch.Tensor, *, chunk_size: int = 64, block: int = 8):
    """The prefill graph's form (module docstring), in two levels: g, u [B, T, D], h0 [B, D] -> h [B, T, D], h_T [B, D].

    Blocks of ``block`` steps are stepped through together (``block`` - 1 unrolled steps, each over every block at
    once: about two passes over [T, D] in all) for their local states from zero; the state before each block is
    then ``chunk_diagonal_scan`` over the T / block block items (its log-depth rounds pass over block-sized data
    only); h = local + A * start, A the product of a over the block's steps so far (exp of an in-block window sum
    of g <= 0). About 10 passes over [T, D] against ~30 for ``chunk_diagonal_scan`` on the tokens themselves."""
    B, T, D = u.shape
    L = block
    n = (T + L - 1) // L
    pad = n * L - T
    gb = F.pad(g, (0, 0, 0, pad)).reshape(B, n, L, D)  # [B, n, L, D]: padded steps do not decay
    ub = F.pad(u, (0, 0, 0, pad)).reshape(B, n, L, D)  # and add nothing
    a = gb.exp()  # [B, n, L, D]
    h, local = ub[:, :, 0], [ub[:, :, 0]]
    for j in range(1, L):  # a fixed number of steps: unrolled in the graph
        h = a[:, :, j] * h + ub[:, :, j]  # [B, n, D]
        local.append(h)
    ends, last = chunk_diagonal_scan(gb.sum(2), h, h0, chunk_size=chunk_size)  # [B, n, D]: the state after each block
    starts = torch.cat([h0[:, None], ends[:, :-1]], dim=1)  # [B, n, D]: the state before each block
    h = torch.stack(local, dim=2) + gb.cumsum(2).exp() * starts[:, :, None]  # [B, n, L, D]
    return h.reshape(B, n * L, D)[:, :T], last


DIAGONAL_FORMS = {"naive": naive_diagonal_scan, "chunk": blocked_diagonal_scan, "step": step_diagonal_scan}

__all__ = [
    "DIAGONAL_FORMS", "blocked_diagonal_scan", "chunk_diagonal_scan", "fused_diagonal_scan", "naive_diagonal_scan",
    "step_diagonal_scan",
]
