"""Mamba-1's selective scan: a linear recurrence with a decay per channel AND per state element, in three forms.

Per batch row, channel d of I and state element n of N (A [I, N] < 0, dt >= 0):

    h_t[d, n] = exp(dt_t[d] A[d, n]) h_{t-1}[d, n] + dt_t[d] B_t[n] x_t[d]          h [B, I, N]
    y_t[d]    = sum_n C_t[n] h_t[d, n]

This is gated linear attention with I heads, key width N and value width 1 (q = C, k = B, v = dt x and the per-key
log-decay g = dt A), but with one value per head edgelin's general chunk form would spend a [C, C, N] decay per head
and chunk on a single value column. The forms here are specialised to it:

- ``naive_selective_scan``: the recurrence above, one token at a time (the reference; run it in float64).
- ``selective_scan_step``: exactly one token (the decode graph).
- ``chunk_selective_scan``: the prefill graph, no loop over time: the I x N elementwise recurrences
  h_t = exp(g_t) h_{t-1} + u_t (g = dt A <= 0, u = dt B x) are edgelin.ops.diagonal's chunked scan over I N channels
  (inside each chunk a Hillis-Steele scan in log2(C) unrolled steps, across chunks a chunk-level decay matrix of
  window sums; every exp is of a sum of g <= 0, never of a positive number), then y_t = h_t C_t.

Memory of the chunk form per batch row, in elements: a few [T, I, N] tensors (every position's state, the scan's
operands) and the chunk-level decay [n + 1, n + 1, I, N] (n = T / C, quadratic in the number of chunks, as every
chunk form in edgelin.ops); work O(T I N log C). Long prompts are prefilled in pieces by the runtime.
"""

from __future__ import annotations

import torch

from edgelin.ops.diagonal import chunk_diagonal_scan


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
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor, h0: torch.Tensor, chunk_size: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked parallel form (module docstring): the same shapes as ``naive_selective_scan``. The I x N
    recurrences are edgelin.ops.diagonal's chunked scan over I N channels; C is contracted after it."""
    _check(x, dt, A, b, c, h0)
    Bt, T, inner = x.shape
    N = A.shape[1]
    g = (dt[..., None] * A).reshape(Bt, T, inner * N)  # [B, T, I N]: the log-decay of each step, <= 0
    u = ((dt[..., None] * b[:, :, None, :]) * x[..., None]).reshape(Bt, T, inner * N)  # [B, T, I N]: what each step adds
    h, last = chunk_diagonal_scan(g, u, h0.reshape(Bt, inner * N), chunk_size=chunk_size)  # [B, T, I N], [B, I N]
    y = (h.reshape(Bt, T, inner, N) * c[:, :, None, :]).sum(-1)  # [B, T, I]
    return y, last.reshape(Bt, inner, N)


SCAN_FORMS = {"naive": naive_selective_scan, "chunk": chunk_selective_scan, "step": selective_scan_step}


__all__ = ["SCAN_FORMS", "chunk_selective_scan", "naive_selective_scan", "selective_scan_step"]
