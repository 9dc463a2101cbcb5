"""Every fast form of linear attention (chunk, recurrent, parallel) against the naive reference.

For every feature map and both normalisations: outputs and every final-state tensor, at awkward lengths
around the chunk size (1, C-1, C, C+1) and a long one, batch 1 and 3, float32 and float64, from a fresh
state and from a non-zero state (the naive form run over a random prefix). The cases are a covering grid
(testkit.covering), not the full product of the seven axes: every pair of axis values appears, every form
runs every length from both states in both dtypes, and every map in every form with and without the
denominator (tests/ops/test_grids.py checks the grid's coverage).

The reference is always the naive form in float64 on the same (float64-cast) inputs, so a float32 run
is measured against the true value, not against another float32 computation.
"""

from __future__ import annotations

import functools

import pytest
import torch

from edgelin.layers.feature_maps import available
from edgelin.ops import FORMS, SEQUENCE_FORMS, recurrent_step
from testkit import rel_err
from testkit.covering import covering, ident
from testkit.linear import D, DTYPE_LABEL, DTYPES, PREFIX, TOLERANCE, cast_state, check_against, feature_map
from testkit.linear import random_qkv as _random_qkv

C = 16  # chunk size
H = 2  # heads
LENGTHS = (1, C - 1, C, C + 1, 500)
FAST_FORMS = ("chunk", "recurrent", "parallel")


def random_qkv(name: str, normalize: bool, B: int, T: int, seed: int):
    # A signed map's denominator phi(q)^T z is a sum of terms of both signs; where it lands near zero the
    # output is ill-conditioned (error ~ eps_machine * sum|terms| / |den|) for *any* summation order, so two
    # correct forms disagree there. Shift q and k so the denominator stays far from zero;
    # tests/ops/test_feature_maps.py covers the crossing itself.
    return _random_qkv(B, H, T, seed, shift=2.0 if feature_map(name).signed and normalize else 0.0)


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


# The grid: every value of every axis, every pair of axes, and in full: every form at every length from a
# fresh and a carried state in both dtypes, and every map with and without the denominator in every form.
AXES = {
    "form": FAST_FORMS, "name": available(), "normalize": (True, False), "T": LENGTHS, "B": (1, 3),
    "dtype": DTYPES, "with_state": (False, True),
}
FULL = (("form", "T", "with_state", "dtype"), ("form", "name", "normalize"))
LABELS = {
    "normalize": lambda n: "den" if n else "noden", "T": lambda t: f"T{t}", "B": lambda b: f"B{b}",
    "dtype": DTYPE_LABEL.get, "with_state": lambda w: "state" if w else "fresh",
}
GRID = covering(AXES, full=FULL)


@pytest.mark.parametrize("form, name, normalize, T, B, dtype, with_state", [pytest.param(*r.values(), id=ident(r, LABELS)) for r in GRID])
def test_fast_form_matches_naive(form, name, normalize, T, B, dtype, with_state):
    q, k, v, initial, ref_o, ref_state = reference(name, normalize, T, B, with_state)
    o, state = FORMS[form](
        q.to(dtype), k.to(dtype), v.to(dtype), feature_map=feature_map(name),
        initial_state=cast_state(initial, dtype), chunk_size=C, normalize=normalize,
    )
    assert list(state) == list(ref_state), "state keys differ from the reference"
    expected_keys = ["S"] + (["z"] if normalize else []) + (["pos"] if feature_map(name).needs_position else [])
    assert sorted(state) == sorted(expected_keys)
    check_against(o, state, ref_o, ref_state, dtype)


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
