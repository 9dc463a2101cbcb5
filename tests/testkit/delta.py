"""The delta rule's reference inputs and outputs (tests/ops/test_delta.py, tests/ops/test_fused.py): q, k unit
vectors, v Gaussian, beta in four regimes, the gate with steps at -20 and ~0, and the naive float64 form's
output from a carried state; ``check``, a fast form's output against the naive one's (also tests/ops/test_kda.py,
tests/ops/test_dplr.py)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from edgelin.ops import l2norm, naive_delta_rule

B, H, K, V, C = 2, 2, 8, 12, 16
PREFIX = 7
LENGTHS = (1, C - 1, C, C + 1, 500)
RULES = ("delta", "gated")
BETAS = ("near0", "uniform", "near1", "neg")


TOLERANCE = {torch.float64: 1e-12, torch.float32: 5e-6}  # a fast form against the naive one, relative to max |naive|

def check(o, state, ref_o, ref_state, dtype, tol=None):
    """A form's output o and state {"S"} against the reference's: dtype, shapes, finite, within ``tol`` (TOLERANCE)."""
    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.dtype == dtype and state["S"].dtype == dtype and o.shape == ref_o.shape
    assert set(state) == {"S"} and state["S"].shape == ref_state["S"].shape
    assert torch.isfinite(o).all() and torch.isfinite(state["S"]).all()
    assert rel_err(o, ref_o) <= tol, f"o: relative error {rel_err(o, ref_o):.3g} > {tol:g}"
    assert rel_err(state["S"], ref_state["S"]) <= tol, f"S: relative error {rel_err(state['S'], ref_state['S']):.3g} > {tol:g}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def make_inputs(T: int, rule: str, betas: str, seed: int, batch: int = B):
    """q, k (unit), v, beta, g (None for DeltaNet), float64."""
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(batch, H, T, K, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(batch, H, T, K, generator=gen, dtype=torch.float64))
    v = torch.randn(batch, H, T, V, generator=gen, dtype=torch.float64)
    u = torch.rand(batch, H, T, generator=gen, dtype=torch.float64)
    beta = {"near0": 1e-3 * u, "uniform": u, "near1": 1 - 1e-3 * u, "neg": 1 + u}[betas]
    g = None
    if rule == "gated":
        g = F.logsigmoid(torch.randn(batch, H, T, generator=gen, dtype=torch.float64) * 2 + 1)
        r = torch.rand(batch, H, T, generator=gen, dtype=torch.float64)
        g = torch.where(r < 0.1, -20.0, torch.where(r > 0.8, -1e-6, g))
    return q, k, v, beta, g


@functools.lru_cache(maxsize=None)
def reference(T: int, rule: str, betas: str):
    """(inputs, initial state, o, final state) from the naive form, float64. Callers must not mutate."""
    p = make_inputs(PREFIX, rule, betas, seed=1)
    _, initial = naive_delta_rule(*p[:4], g=p[4])
    x = make_inputs(T, rule, betas, seed=100 + T)
    o, final = naive_delta_rule(*x[:4], g=x[4], initial_state=initial)
    return x, initial, o, final


__all__ = ["B", "BETAS", "C", "H", "K", "LENGTHS", "PREFIX", "RULES", "V", "make_inputs", "reference", "rel_err"]
