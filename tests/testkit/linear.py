"""The reference inputs of the op-form tests (tests/ops): feature maps, random q/k/v, state casts and the check
of a fast form's output and state against the naive float64 reference.

Sizes are the tests' own (head width D, features of the random maps, cosFormer's horizon); the head count is
an argument, since the undecayed and the decayed suites use different ones.
"""

from __future__ import annotations

import functools

import torch

from edgelin.layers.feature_maps import make_feature_map
from edgelin.ops import REFERENCE_TOLERANCE
from edgelin.parity import rel_max
from edgelin.state import state_mismatch

TOLERANCE = REFERENCE_TOLERANCE  # the ops' accuracy contract (edgelin.ops): relative error per tensor, by dtype
D = 8  # head width (Dk = Dv = D)
N_FEATURES = 12  # performer: F != D and not a multiple of D (a partial orthogonal block)
HORIZON = 1024  # cosformer: long enough that every weight is positive, short enough that sin matters
PREFIX = 7  # tokens run through the naive form to make a non-zero initial state


@functools.lru_cache(maxsize=None)
def feature_map(name: str):
    """The map ``name`` at width D, parameters drawn from seed 0; the same object on every call."""
    torch.manual_seed(0)  # learned maps draw their parameters from the global generator
    fm = make_feature_map(name, D, n_features=N_FEATURES, seed=0, horizon=HORIZON)
    if name == "elementwise_product":
        # Signed through its weights (a product of two affine maps), so shifting q and k does not keep its
        # denominator away from zero. Biases of +5 keep both factors positive on these inputs.
        with torch.no_grad():
            for layer in (fm.q.layer1, fm.q.layer2):
                layer.bias.add_(5.0)
    return fm


def random_qkv(B: int, H: int, T: int, seed: int, shift: float = 0.0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B, H, T, D] float64 from ``seed``; ``shift`` is added to q and k."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    return (q + shift, k + shift, v) if shift else (q, k, v)


def cast_state(state, dtype):
    if state is None:
        return None
    return {n: t.to(dtype) if t.is_floating_point() else t.clone() for n, t in state.items()}


def check_against(o, state, ref_o, ref_state, dtype, tol=None):
    """A fast form's (o, state) against the reference: shape, dtype, finite, relative error within ``tol``
    (default: the contract for ``dtype``), the state's keys, shapes and values."""
    tol = TOLERANCE[dtype] if tol is None else tol
    assert o.shape == ref_o.shape and o.dtype == dtype, f"output {tuple(o.shape)} {o.dtype} != {tuple(ref_o.shape)} {dtype}"
    assert torch.isfinite(o).all(), "non-finite output"
    err = rel_max(o, ref_o)
    assert err <= tol, f"output: relative error {err:.3g} > {tol:g}"
    assert not (why := state_mismatch(state, ref_state, tol=tol, float_dtype=dtype)), why


DTYPES = (torch.float64, torch.float32)
DTYPE_LABEL = {torch.float64: "f64", torch.float32: "f32"}

__all__ = ["D", "DTYPES", "DTYPE_LABEL", "HORIZON", "N_FEATURES", "PREFIX", "TOLERANCE", "cast_state", "check_against", "feature_map", "random_qkv"]
