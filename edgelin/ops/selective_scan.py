"""Mamba-1's selective scan: a linear recurrence with a decay per channel AND per state element, in three forms.

Per batch row, channel d of D and state element n of N (A [D, N] < 0, dt >= 0):

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]          h [B, D, N]
    y_t[d]    = sum_n C_t[n] h_t[d, n]

This is gated linear attention with D heads, key width N and value width 1 (q = C, k = B, v = dt x and the per-key
log-decay g = dt A), but with one value per head edgelin's general chunk form would spend a [C, C, N] decay per head
and chunk on a single value column. The form here is specialised to it:

- ``naive_selective_scan``: the recurrence above, one token at a time (the reference; run it in float64).
- ``selective_scan_step``: exactly one token (the decode graph).
- ``chunk_selective_scan``: the prefill graph, no loop over time. The sequence is cut into chunks of C tokens
  (zero-padded: dt = 0 there, so a padded step neither decays nor adds). Inside a chunk, every position's state
  from a zero start is an inclusive scan of the pairs (a_t, u_t) = (exp(dt_t A), dt_t B_t x_t) under
  (a, u) o (a', u') = (a a', a' u + u'), done Hillis-Steele style in log2(C) unrolled steps on the static chunk axis
  (Pad, Slice, Mul, Add): afterwards a_t is the decay from the chunk start through t (a product of factors <= 1)
  and u_t the state at t from a zero start. Across chunks, the state each chunk starts from is a chunk-level
  decay matrix on the chunk totals (the initial state as item 0), as in edgelin.ops.chunk:

      [S_0, ..., S_n] = exp(L') @ [h_0, u_end(0), ..., u_end(n-1)],   L' = relative_log_decay([0, sum_chunk(0) g, ...])

  and h_t = a_t S_m + u_t inside chunk m. Every exp is of a window sum of g = dt A <= 0 (never of a positive
  number, never a difference of running sums), so long inputs stay exact in float32.

Memory of the chunk form per batch row, in elements: a few [T, D, N] tensors (the per-position states, the scan's
operands) and the chunk-level decay [n + 1, n + 1, D, N] (n = T / C, quadratic in the number of chunks, as every
chunk form in edgelin.ops). The work is O(T D N log C). Long prompts are prefilled in pieces by the runtime.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgelin.ops.common import relative_log_decay


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor) -> None:
    Bt, T, D = x.shape
    N = A.shape[1]
    expected = {"dt": (dt, (Bt, T, D)), "A": (A, (D, N)), "B": (b, (Bt, T, N)), "C": (c, (Bt, T, N)), "h0": (h0, (Bt, D, N))}
    for name, (t, shape) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"selective scan: {name} must have shape {list(shape)} for x {list(x.shape)} and A {list(A.shape)}, "
                             f"got {list(t.shape)}")


def naive_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token: x, dt [B, T, D], A [D, N], b, c [B, T, N], h0 [B, D, N] -> (y [B, T, D], h_T)."""
    _check(x, dt, A, b, c, h0)
    h, ys = h0, []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t, :, None] * A)  # [B, D, N]
        h = decay * h + (dt[:, t, :, None] * b[:, t, None, :]) * x[:, t, :, None]  # [B, D, N]
        ys.append((h * c[:, t, None, :]).sum(-1))  # [B, D]
    return torch.stack(ys, dim=1), h  # [B, T, D], [B, D, N]


def selective_scan_step(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token (T = 1; Reshapes, no Gather): the same shapes as ``naive_selective_scan``."""
    Bt, T, D = x.shape
    if T != 1:
        raise ValueError(f"selective_scan_step takes one token, got a sequence of {T}")
    N = A.shape[1]
    dt1, x1 = dt.reshape(Bt, D, 1), x.reshape(Bt, D, 1)  # [B, D, 1]
    h = torch.exp(dt1 * A) * h0 + (dt1 * b.reshape(Bt, 1, N)) * x1  # [B, D, N]
    y = (h * c.reshape(Bt, 1, N)).sum(-1)  # [B, D]
    return y.reshape(Bt, 1, D), h


def _shift(t: torch.Tensor, k: int, fill: float) -> torch.Tensor:
    """t [B, n, C, D, N] moved k positions later along the chunk axis, the first k filled with ``fill``."""
    return F.pad(t[:, :, : t.shape[2] - k], (0, 0, 0, 0, k, 0), value=fill)


def chunk_selective_scan(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked parallel form (module docstring): the same shapes as ``naive_selective_scan``."""
    _check(x, dt, A, b, c, h0)
    Bt, T, D = x.shape
    N, C = A.shape[1], chunk_size
    n = (T + C - 1) // C
    pad = n * C - T
    dt = F.pad(dt, (0, 0, 0, pad)).reshape(Bt, n, C, D)  # [B, n, C, D]: 0 on padded steps
    x = F.pad(x, (0, 0, 0, pad)).reshape(Bt, n, C, D)  # [B, n, C, D]
    b = F.pad(b, (0, 0, 0, pad)).reshape(Bt, n, C, 1, N)  # [B, n, C, 1, N]
    c = F.pad(c, (0, 0, 0, pad)).reshape(Bt, n, C, 1, N)  # [B, n, C, 1, N]

    g = dt[..., None] * A  # [B, n, C, D, N]: the log-decay of each step, <= 0
    a = torch.exp(g)  # [B, n, C, D, N]
    u = (dt[..., None] * b) * x[..., None]  # [B, n, C, D, N]: what each step adds
    k = 1
    while k < C:  # log2(C) unrolled steps: (a, u)_t <- (a_{t-k}, u_{t-k}) o (a, u)_t
        u = u + a * _shift(u, k, 0.0)
        a = a * _shift(a, k, 1.0)
        k *= 2

    totals = g.sum(2)  # [B, n, D, N]: the log-decay across each chunk
    totals = torch.cat([torch.zeros_like(totals[:, :1]), totals], dim=1)  # [B, n + 1, D, N]
    across = relative_log_decay(totals, dim=1).exp()  # [B, n + 1, n + 1, D, N]
    items = torch.cat([h0[:, None], u[:, :, -1]], dim=1)  # [B, n + 1, D, N]: h0, then each chunk's state from zero
    starts = (across * items[:, None]).sum(2)  # [B, n + 1, D, N]: the state before each chunk, then the final one

    h = a * starts[:, :n, None] + u  # [B, n, C, D, N]: every position's state
    y = (h * c).sum(-1)  # [B, n, C, D]
    return y.reshape(Bt, n * C, D)[:, :T], starts[:, n]  # [B, T, D], [B, D, N]


SCAN_FORMS = {"naive": naive_selective_scan, "chunk": chunk_selective_scan, "step": selective_scan_step}


__all__ = ["SCAN_FORMS", "chunk_selective_scan", "naive_selective_scan", "selective_scan_step"]
