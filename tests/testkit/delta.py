"""The delta rule's reference inputs and outputs (tests/ops/test_delta.py, tests/ops/test_fused.py): q, k unit
vectors, v Gaussian, beta in four regimes, the gate with steps at -20 and ~0, and the naive float64 form's
output from a carried state; ``check``, a fast form's output against the naive one's (also tests/ops/test_kda.py,
tests/ops/test_dplr.py)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
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


def fla_naive(rel_path: str):
    """fla's pure-PyTorch reference file ``rel_path`` (under the fla package) loaded by path: ``import fla.ops`` needs
    triton and a GPU driver, these files need only torch and einops. Skips where fla or einops is not installed."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None or importlib.util.find_spec("einops") is None:
        pytest.skip("flash-linear-attention (and einops) not installed")
    path = Path(spec.origin).parent / rel_path
    if not path.is_file():
        pytest.skip(f"fla has no {rel_path}")
    module_spec = importlib.util.spec_from_file_location(f"_fla_{path.stem}_{path.parent.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def strong_gates(tensors: dict[str, torch.Tensor]) -> None:
    """A saved delta-rule checkpoint's gates from keep-everything to forget-at-once, and beta driven to its ends:
    exp(A_log) in {0.01, 1, 4, 16} per value head and dt_bias in {-5, 0, 1, 2} (per channel for KDA: every head sees
    all four) give log-decays from about -7e-5 to -34 per step; b_proj scaled 30x puts beta near 0 and near 1."""
    for name, t in tensors.items():
        if name.endswith("A_log"):
            t.copy_(torch.tensor([0.01, 1.0, 4.0, 16.0]).log().repeat(t.numel() // 4))
        elif name.endswith("dt_bias"):
            t.copy_(torch.tensor([-5.0, 0.0, 1.0, 2.0]).repeat(t.numel() // 4))
        elif name.endswith("b_proj.weight"):
            t.mul_(30.0)
