"""Every fast form of linear attention (chunk, recurrent, parallel) against the naive reference.

For every feature map and both normalisations: outputs and every final-state tensor, at awkward lengths
around the chunk size (1, C-1, C, C+1) and a long one, batch 1 and 3, float32 and float64, from a fresh
state and from a non-zero state (the naive form run over a random prefix).

The reference is always the naive form in float64 on the same (float64-cast) inputs, so a float32 run
is measured against the true value, not against another float32 computation.
"""

from __future__ import annotations

import functools

import pytest
import torch

from edgelin.feature_maps import available, make_feature_map
from edgelin.state import state_mismatch
from edgelin.ops import FORMS, REFERENCE_TOLERANCE, SEQUENCE_FORMS, recurrent_step


TOLERANCE = REFERENCE_TOLERANCE  # the ops' accuracy contract (edgelin.ops): relative error per tensor, by dtype
TINY = 1e-300

C = 16  # chunk size
H, D = 2, 8  # heads, head width (Dk = Dv = D)
N_FEATURES = 12  # performer: F != D and not a multiple of D (a partial orthogonal block)
HORIZON = 1024  # cosformer: long enough that every weight is positive, short enough that sin matters
PREFIX = 7  # tokens run through the naive form to make a non-zero initial state
LENGTHS = (1, C - 1, C, C + 1, 500)
FAST_FORMS = ("chunk", "recurrent", "parallel")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(TINY)).item()


@functools.lru_cache(maxsize=None)
def feature_map(name: str):
    torch.manual_seed(0)  # learned maps draw their parameters from the global generator
    fm = make_feature_map(name, D, n_features=N_FEATURES, seed=0, horizon=HORIZON)
    if name == "elementwise_product":
        # Signed through its weights (a product of two affine maps), so shifting q and k (random_qkv) does not
        # keep its denominator away from zero. Biases of +5 keep both factors positive on these inputs.
        with torch.no_grad():
            for layer in (fm.q.layer1, fm.q.layer2):
                layer.bias.add_(5.0)
    return fm


def random_qkv(name: str, normalize: bool, B: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(3))
    if feature_map(name).signed and normalize:
        # A signed map's denominator phi(q)^T z is a sum of terms of both signs; where it lands near zero
        # the output is ill-conditioned (error ~ eps_machine * sum|terms| / |den|) for *any* summation
        # order, so two correct forms disagree there. Shift q and k so the denominator stays far from
        # zero; tests/ops/test_feature_maps.py covers the crossing itself.
        q, k = q + 2.0, k + 2.0
    return q, k, v


@functools.lru_cache(maxsize=None)
def reference(name: str, normalize: bool, T: int, B: int, with_state: bool):
    """(q, k, v, initial_state, o, final_state), all float64, from the naive form. Callers must not mutate."""
    fm = feature_map(name)
    initial = None
    if with_state:
        prefix = random_qkv(name, normalize, B, PREFIX, seed=1000 + 10 * T + B)
        _, initial = FORMS["naive"](*prefix, feature_map=fm, chunk_size=C, normalize=normalize)
    q, k, v = random_qkv(name, normalize, B, T, seed=10 * T + B)
    o, final = FORMS["naive"](q, k, v, feature_map=fm, initial_state=initial, chunk_size=C, normalize=normalize)
    return q, k, v, initial, o, final


def cast_state(state, dtype):
    if state is None:
        return None
    return {n: t.to(dtype) if t.is_floating_point() else t.clone() for n, t in state.items()}


def _cases():
    dtypes = {torch.float64: "f64", torch.float32: "f32"}
    for form in FAST_FORMS:
        for name in available():
            for normalize in (True, False):
                for T in LENGTHS:
                    for B in (1, 3):
                        for dtype, dname in dtypes.items():
                            for with_state in (False, True):
                                ident = (
                                    f"{form}-{name}-{'den' if normalize else 'noden'}-T{T}-B{B}-{dname}"
                                    f"-{'state' if with_state else 'fresh'}"
                                )
                                yield pytest.param(form, name, normalize, T, B, dtype, with_state, id=ident)


@pytest.mark.parametrize("form, name, normalize, T, B, dtype, with_state", list(_cases()))
def test_fast_form_matches_naive(form, name, normalize, T, B, dtype, with_state):
    q, k, v, initial, ref_o, ref_state = reference(name, normalize, T, B, with_state)
    o, state = FORMS[form](
        q.to(dtype), k.to(dtype), v.to(dtype), feature_map=feature_map(name),
        initial_state=cast_state(initial, dtype), chunk_size=C, normalize=normalize,
    )
    tol = TOLERANCE[dtype]
    assert o.shape == ref_o.shape and o.dtype == dtype
    assert rel_err(o, ref_o) <= tol, f"output: relative error {rel_err(o, ref_o):.3g} > {tol:g}"
    assert list(state) == list(ref_state), "state keys differ from the reference"
    expected_keys = ["S"] + (["z"] if normalize else []) + (["pos"] if feature_map(name).needs_position else [])
    assert sorted(state) == sorted(expected_keys)
    assert not (why := state_mismatch(state, ref_state, tol=tol, float_dtype=dtype)), why


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("normalize", [True, False], ids=["den", "noden"])
@pytest.mark.parametrize("name", available())
def test_chunk_form_any_chunk_size(name, normalize, chunk_size):
    """T=37 against chunk sizes that divide it, don't, equal it, and exceed it."""
    fm = feature_map(name)
    q, k, v = random_qkv(name, normalize, 2, 37, seed=7)
    ref_o, ref_state = FORMS["naive"](q, k, v, feature_map=fm, normalize=normalize)
    o, state = FORMS["chunk"](q, k, v, feature_map=fm, chunk_size=chunk_size, normalize=normalize)
    assert rel_err(o, ref_o) <= TOLERANCE[torch.float64]
    for key in ref_state:
        assert rel_err(state[key], ref_state[key]) <= TOLERANCE[torch.float64], key


@pytest.mark.parametrize("form", FAST_FORMS)
@pytest.mark.parametrize("name", available())
def test_state_carried_across_calls(form, name):
    """A fast form run in two calls, its own state passed on, equals the naive form over the whole sequence."""
    fm = feature_map(name)
    q, k, v = random_qkv(name, True, 2, 2 * C + 3, seed=11)
    ref_o, ref_state = FORMS["naive"](q, k, v, feature_map=fm)
    cut = C + 5
    o1, s1 = FORMS[form](q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], feature_map=fm, chunk_size=C)
    o2, s2 = FORMS[form](q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], feature_map=fm, initial_state=s1, chunk_size=C)
    assert rel_err(torch.cat([o1, o2], dim=2), ref_o) <= TOLERANCE[torch.float64]
    for key in ref_state:
        assert rel_err(s2[key], ref_state[key]) <= TOLERANCE[torch.float64], key


@pytest.mark.parametrize("form", SEQUENCE_FORMS)
@pytest.mark.parametrize("name", available())
def test_initial_state_is_not_modified(form, name):
    """No form updates the state it was given in place."""
    _, _, _, initial, _, _ = reference(name, True, C + 1, 3, True)
    given = {n: t.clone() for n, t in initial.items()}
    q, k, v = random_qkv(name, True, 3, C + 1, seed=3)
    _, out = FORMS[form](q, k, v, feature_map=feature_map(name), initial_state=given, chunk_size=C)
    for key in initial:
        assert torch.equal(given[key], initial[key]), f"{form} modified initial_state[{key!r}] in place"
        assert out[key] is not given[key]


def test_recurrent_step_takes_one_token():
    fm = feature_map("elu+1")
    q = torch.randn(1, H, 2, D)
    with pytest.raises(ValueError, match="one token"):
        recurrent_step(q, q, q, feature_map=fm)
