"""Ragged batches: rows of different lengths in one call, right-padded to the longest.

``lengths`` [B] int64 gives each row's number of real tokens; positions t >= lengths[b] are padding.
A padded position must leave every state exactly as the row's last real token left it:

- its key feature phi(k) and its value are zeroed *after* the feature map (phi(0) is not 0 for every
  map: elu+1 gives 1), so it adds nothing to S or z;
- its log-decay g is 0 (a decay of 1), so the state does not fade over the padding;
- the position state ("pos", cosFormer) moves on by the row's length, not by T (``advance`` takes the
  [B] tensor in place of an int).

Outputs at padded positions are computed (finite, causal: they never reach a real position) but mean
nothing. ``lengths`` may be 0 for a row (it leaves the row's state as it was), and at most T.
"""

from __future__ import annotations

import torch


def padding_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[B, T] bool: True at the real positions t < lengths[b]."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]  # [B, T]


def mask_padding(
    fk: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, lengths: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """phi(k) [B, H, T, F], v [B, H, T, Dv] and g ([B, H, T(, F)] or None) with padded positions zeroed;
    unchanged (the same tensors, no op) when ``lengths`` is None."""
    if lengths is None:
        return fk, v, g
    real = padding_mask(lengths, fk.shape[2])[:, None, :, None]  # [B, 1, T, 1]
    fk = torch.where(real, fk, 0.0)  # [B, H, T, F]
    v = torch.where(real, v, 0.0)  # [B, H, T, Dv]
    if g is not None:
        g = torch.where(real if g.dim() == 4 else real[..., 0], g, 0.0)  # [B, H, T(, F)]: no decay on padding
    return fk, v, g


def check_lengths(lengths: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``lengths`` as int64 [B] for input ids of ``shape`` [B, T]; ValueError unless every 0 <= length <= T
    (the values are checked in eager mode only: an exported graph cannot raise on data, so the export's graph
    wrapper clamps them to [0, T], exporters/graphs.py)."""
    B, T = shape
    integer = isinstance(lengths, torch.Tensor) and not (lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool)
    if not integer or tuple(lengths.shape) != (B,):
        got = f"{lengths.dtype} {list(lengths.shape)}" if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be an integer tensor of shape [B] = [{B}] (real tokens per row), got {got}")
    if not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
        bad = (lengths < 0) | (lengths > T)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"lengths[{b}] is {int(lengths[b])}; each row's length must be in [0, T = {T}]")
    return lengths.to(torch.int64)


def steps(length: int, lengths: torch.Tensor | None) -> int | torch.Tensor:
    """How far each row's position moves: T, or each row's length [B]."""
    return length if lengths is None else lengths


__all__ = ["check_lengths", "mask_padding", "padding_mask", "steps"]
