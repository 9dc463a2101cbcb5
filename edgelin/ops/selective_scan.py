"""Mamba-1's selective scan: a linear recurrence with a decay per channel AND per state element, in three forms.

Per batch row, channel d of I and state element n of N (A [I, N] < 0, dt >= 0):

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]          h [B, I, N]
    y_t[d]    = sum_n C_t[n] h_t[d, n]

This is gated linear attention with I heads, key width N and value width 1 (q = C, k = B, v = dt x and the per-key
log-decay g = dt A), but with one value per head edgelin's general chunk form would spend a [C, C, N] decay per head
and chunk on a single value column. The forms here are specialised to it:

- ``naive_selective_scan``: the recurrence above, one token at a time (the reference; run it in float64).
- ``selective_scan_step``: exactly one token (the decode graph).
- ``chunk_selective_scan``: the prefill graph, no Loop or Scan node, any T. The I x N elementwise recurrences
  h_t = a_t h_{t-1} + u_t (a = exp(g), g = dt A <= 0, u = dt B x) are cut into short chunks of L = ``UNROLL`` (8)
  steps, zero-padded (g = 0 and u = 0 change nothing). All short chunks advance together through L - 1 unrolled steps
  on [B, n, I N] slices: each short chunk's state from a zero start and its decay from its start (running products of
  factors in (0, 1]). The state each short chunk starts from is the chunk-level recurrence
  S_m = exp(sum of chunk m's g) S_{m-1} + (its local end state), itself a diagonal recurrence over n = T / L items,
  run by edgelin.ops.diagonal's chunked scan (chunks of ``chunk_size`` items: a log-depth scan inside, a decay matrix
  of window sums across). Every exp is of g or of a sum of g (<= 0), never of a positive number or a difference of
  running sums. Then h = local + decay * start and y_t = h_t C_t.

Cost, per batch row: about a dozen passes over [T, I, N] tensors (the log-depth scan over all T steps would take
~50, and its ONNX Runtime prefill was 2.5x slower at hidden 256, T = 512), plus the diagonal scan over T / L items
(its chunk-level decay [n / C + 1, n / C + 1, I N] is quadratic in T / (L C), tiny for prompts of a few thousand
tokens, which the runtime prefills in pieces). Memory: a few [T, I, N] tensors (every position's state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgelin.ops.diagonal import chunk_diagonal_scan

UNROLL = 8  # the short chunks' length (module docstring)


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor) -> None:
    Bt, T, I = x.shape
    N = A.shape[1]
    expected = {"dt": (dt, (Bt, T, I)), "A": (A, (I, N)), "B": (b, (Bt, T, N)), "C": (c, (Bt, T, N)), "h0": (h0, (Bt, I, N))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"selective scan: {name} must have shape {list(shape)} for x {list(x.shape)} and A {list(A.shape)}, "
                             f"got {list(t.shape)}")


def naive_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token: x, dt [B, T, I], A [I, N], b, c [B, T, N], h0 [B, I, N] -> (y [B, T, I], h_T)."""
    _check(x, dt, A, b, c, h0)
    h, ys = h0, []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t, :, None] * A)  # [B, I, N]
        h = decay * h + (dt[:, t, :, None] * b[:, t, None, :]) * x[:, t, :, None]  # [B, I, N]
        ys.append((h * c[:, t, None, :]).sum(-1))  # [B, I]
    return torch.stack(ys, dim=1), h  # [B, T, I], [B, I, N]


def selective_scan_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (T = 1; Reshapes, no Gather): the same shapes as ``naive_selective_scan``."""
    Bt, T, I = x.shape
    if T != 1:
        raise ValueError(f"selective_scan_step takes one token, got a sequence of {T}")
    N = A.shape[1]
    dt1, x1 = dt.reshape(Bt, I, 1), x.reshape(Bt, I, 1)  # [B, I, 1]
    h = torch.exp(dt1 * A) * h0 + (dt1 * b.reshape(Bt, 1, N)) * x1  # [B, I, N]
    y = (h * c.reshape(Bt, 1, N)).sum(-1)  # [B, I]
    return y.reshape(Bt, 1, I), h


def chunk_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor, chunk_size: int = 64,
    *, unroll: int = UNROLL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked parallel form (module docstring): the same shapes as ``naive_selective_scan``; ``unroll``: the
    length L of the short chunks stepped through in the graph, ``chunk_size``: edgelin.ops.diagonal's chunk over them."""
    _check(x, dt, A, b, c, h0)
    Bt, T, inner = x.shape
    N, L = A.shape[1], unroll
    M = inner * N
    n = (T + L - 1) // L
    pad = n * L - T
    g = F.pad((dt[..., None] * A).reshape(Bt, T, M), (0, 0, 0, pad)).reshape(Bt, n, L, M)  # [B, n, L, I N]: log-decays, <= 0
    u = ((dt[..., None] * b[:, :, None, :]) * x[..., None]).reshape(Bt, T, M)  # [B, T, I N]: what each step adds
    u = F.pad(u, (0, 0, 0, pad)).reshape(Bt, n, L, M)  # [B, n, L, I N]: padded steps neither decay nor add
    a = g.exp()  # [B, n, L, I N], in (0, 1]
    local, decay = [u[:, :, 0]], [a[:, :, 0]]
    for t in range(1, L):  # every short chunk at once, one position at a time: L - 1 unrolled steps on [B, n, I N]
        local.append(a[:, :, t] * local[-1] + u[:, :, t])
        decay.append(a[:, :, t] * decay[-1])
    local, decay = torch.stack(local, dim=2), torch.stack(decay, dim=2)  # [B, n, L, I N]: state from zero, decay from the start
    # the state after each short chunk: S_m = exp(sum of its g) S_{m-1} + its local end state, a diagonal scan over n items
    ends, last = chunk_diagonal_scan(g.sum(2), local[:, :, -1], h0.reshape(Bt, M), chunk_size=chunk_size)  # [B, n, I N], [B, I N]
    starts = torch.cat([h0.reshape(Bt, 1, M), ends[:, :-1]], dim=1)  # [B, n, I N]: the state each short chunk starts from
    h = (local + decay * starts[:, :, None]).reshape(Bt, n * L, inner, N)[:, :T]  # [B, T, I, N]: every position's state
    return (h * c[:, :, None, :]).sum(-1), last.reshape(Bt, inner, N)  # [B, T, I], [B, I, N]


SCAN_FORMS = {"naive": naive_selective_scan, "chunk": chunk_selective_scan, "step": selective_scan_step}


__all__ = ["SCAN_FORMS", "chunk_selective_scan", "naive_selective_scan", "selective_scan_step"]
