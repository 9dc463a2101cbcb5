"""Sampling: masks, temperature, seeded determinism, option checks."""

import numpy as np
import pytest

from edgelin.errors import RuntimeInputError
from edgelin.runtime.sampling import Sampler, softmax, top_k_mask, top_p_mask


def logits_of(probs):
    return np.log(np.asarray(probs, dtype=np.float64))[None]  # [1, V]


def test_top_k_mask_keeps_the_k_largest():
    x = np.array([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    assert top_k_mask(x, 2).tolist() == [[False, True, False, True, False], [True, True, False, False, False]]
    assert top_k_mask(x, 1).sum(axis=-1).tolist() == [1, 1]


@pytest.mark.parametrize("k", [0, 5, 9])
def test_top_k_off_or_larger_than_vocab_keeps_all(k):
    assert top_k_mask(np.random.default_rng(0).standard_normal((2, 5)), k).all()


@pytest.mark.parametrize(
    "p, kept",
    [(0.01, [0]), (0.5, [0]), (0.7, [0, 1]), (0.9, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_mask_keeps_the_smallest_set_reaching_p(p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05, shuffled so the order in the vocabulary is not the rank order
    probs = np.array([0.15, 0.5, 0.05, 0.3])
    rank_to_id = [1, 3, 0, 2]
    mask = top_p_mask(logits_of(probs), p)[0]
    assert sorted(np.flatnonzero(mask).tolist()) == sorted(rank_to_id[r] for r in kept)


def test_masked_tokens_are_never_sampled():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50))
    sampler = Sampler(temperature=1.5, top_k=5, top_p=0.9, seed=0)
    allowed = top_k_mask(logits / 1.5, 5) & top_p_mask(logits / 1.5, 0.9)
    gen = sampler.rng()
    for _ in range(300):
        ids = sampler(logits, gen)
        assert allowed[np.arange(4), ids].all()


def test_sampling_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.2])
    sampler = Sampler(temperature=1.0, seed=123)
    gen = sampler.rng()
    draws = np.concatenate([sampler(np.repeat(logits_of(probs), 100, axis=0), gen) for _ in range(200)])  # 20k draws
    freq = np.bincount(draws, minlength=3) / draws.size
    assert np.abs(freq - probs).max() < 0.015, freq


def test_temperature_zero_is_greedy_and_ignores_the_seed():
    logits = np.random.default_rng(1).standard_normal((3, 40))
    for seed in (None, 0, 7):
        s = Sampler(temperature=0.0, seed=seed)
        assert s(logits, s.rng()).tolist() == logits.argmax(-1).tolist()


def test_very_low_temperature_approaches_greedy():
    logits = np.random.default_rng(2).standard_normal((3, 40))
    s = Sampler(temperature=1e-4, seed=0)
    assert s(logits, s.rng()).tolist() == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = np.random.default_rng(3).standard_normal((2, 256))

    def draw(seed):
        s = Sampler(temperature=1.0, top_p=0.95, seed=seed)
        gen = s.rng()
        return [s(logits, gen).tolist() for _ in range(20)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_probs_are_renormalised_over_the_kept_tokens():
    s = Sampler(temperature=1.0, top_k=2)
    p = s.probs(logits_of([0.5, 0.3, 0.2]))[0]
    np.testing.assert_allclose(p, [0.625, 0.375, 0.0], rtol=1e-12)
    np.testing.assert_allclose(softmax(np.array([[0.0, 0.0]])), [[0.5, 0.5]])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e6), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.2), "top_p"),
        (dict(seed=-1), "seed"), (dict(seed="x"), "seed"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(RuntimeInputError, match=match):
        Sampler(**kwargs)


# ---- the fast path (no full sort) against the full-sort reference --------------------------------
# The reference is the implementation the runtime had before: it sorts the whole row. The runtime must
# give the same masks, the same float64 probabilities bit for bit and so the same seeded draws.

def reference_softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def reference_top_k_mask(x, k):
    if k <= 0 or k >= x.shape[-1]:
        return np.ones(x.shape, dtype=bool)
    return x >= np.sort(x, axis=-1)[..., -k, None]


def reference_top_p_mask(x, p):
    if p >= 1.0:
        return np.ones(x.shape, dtype=bool)
    probs = reference_softmax(x)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked
    mask = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(mask, order, before < p, axis=-1)
    return mask


def reference_probs(logits, temperature, top_k, top_p):
    x = logits.astype(np.float64) / temperature
    return reference_softmax(np.where(reference_top_k_mask(x, top_k) & reference_top_p_mask(x, top_p), x, -np.inf))


def reference_draws(probs, rng, n):
    cdf = np.cumsum(probs, axis=-1)
    out = []
    for _ in range(n):
        u = rng.random(cdf.shape[0]) * cdf[:, -1]
        out.append(np.minimum((cdf <= u[:, None]).sum(axis=-1), cdf.shape[-1] - 1).tolist())
    return out


def _awkward_logits():
    """name -> float32 logits [B, V]: the cases where a selection could go wrong."""
    g = np.random.default_rng(42)
    V = 250_000
    cases = {
        "V=1": np.array([[0.3]], dtype=np.float32),
        "V=2 tie": np.array([[1.0, 1.0]], dtype=np.float32),
        "normal V=5000": g.standard_normal((1, 5000)).astype(np.float32) * 3,
        "V=250k normal x3": g.standard_normal((1, V)).astype(np.float32) * 3,
        "V=250k peaked": (g.standard_normal((1, V)) * 40).astype(np.float32),
        "V=250k flat": (g.standard_normal((1, V)) * 1e-3).astype(np.float32),
        "V=250k all equal": np.zeros((1, V), dtype=np.float32),
        "batch of 3, V=65536": np.stack([g.standard_normal(65536) * s for s in (0.2, 3.0, 30.0)]).astype(np.float32),
    }
    # ties that straddle every cutoff: 4 top values, then 3000 equal ones, then the rest lower
    tied = g.standard_normal((2, 32000)).astype(np.float32) - 20
    tied[:, 100:3100] = 1.0
    tied[:, [7, 50000 % 32000, 31999, 5]] = [6.0, 5.0, 5.0, 4.0]
    cases["ties at the cutoff V=32k"] = tied
    # -inf: most of the vocabulary banned, a few finite (the nucleus has all the mass), ties at zero
    banned = np.full((2, V), -np.inf, dtype=np.float32)
    banned[0, [3, 99_999, 200_001]] = [0.5, 2.0, 2.0]
    banned[1, :5000] = g.standard_normal(5000).astype(np.float32)
    cases["-inf V=250k"] = banned
    spotted = (g.standard_normal((1, 65536)) * 2).astype(np.float32)
    spotted[0, g.choice(65536, 20000, replace=False)] = -np.inf
    cases["-inf spotted V=65536"] = spotted
    return cases


AWKWARD = _awkward_logits()
OPTIONS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0), (1.0, 1, 1.0), (0.7, 50, 1.0), (1.0, 10**9, 1.0), (1.0, 0, 0.9), (1.0, 0, 0.5), (1.3, 0, 0.99),
    (1.0, 0, 1e-9), (1.0, 0, 0.999999), (1.0, 0, 1 - 1e-13), (0.5, 40, 0.8), (1.0, 1, 0.5), (1.0, 5000, 0.9),
    (1.0, 3002, 0.95), (1e-4, 0, 0.9), (100.0, 0, 0.3), (2.0, 4, 0.999999),
]
LARGE = [(0, 0.9), (40, 0.8), (0, 0.5), (0, 1e-9), (0, 1 - 1e-13), (5000, 0.9), (50, 1.0)]  # (top_k, top_p) at V = 250k


@pytest.fixture(params=["default rounds", "tiny rounds"])
def rounds(request, monkeypatch):
    """The default candidate growth, and a tiny one (2 candidates, doubling) that takes many rounds and
    the top-k bound on every case."""
    import edgelin.runtime.sampling as sampling

    if request.param == "tiny rounds":
        monkeypatch.setattr(sampling, "FIRST_CANDIDATES", 2)
        monkeypatch.setattr(sampling, "GROWTH", 2)
    return request.param


@pytest.mark.parametrize("name", list(AWKWARD))
def test_the_fast_path_equals_the_full_sort_bit_for_bit(name, rounds):
    logits = AWKWARD[name]
    x = logits.astype(np.float64)
    large = logits.shape[-1] > 70_000  # the reference is slow there: fewer options, fewer still for the tiny rounds
    for temperature, k, p in OPTIONS:
        if large and (k, p) not in (LARGE if rounds == "default rounds" else LARGE[:2]):
            continue
        what = f"{name}: temperature {temperature}, top_k {k}, top_p {p}"
        assert np.array_equal(top_k_mask(x, k), reference_top_k_mask(x, k)), what
        assert np.array_equal(top_p_mask(x / temperature, p), reference_top_p_mask(x / temperature, p)), what
        got = Sampler(temperature, k, p).probs(logits)
        want = reference_probs(logits, temperature, k, p)
        assert got.dtype == np.float64 and np.array_equal(got, want), what
        s = Sampler(temperature, k, p, seed=11)
        gen = s.rng()
        assert [s(logits, gen).tolist() for _ in range(5)] == reference_draws(want, np.random.default_rng(11), 5), what


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_non_finite_rows_behave_as_the_full_sort_did():
    """NaN, +inf and an all -inf row are not the fast path's business: the same output, NaNs and all."""
    x = np.random.default_rng(5).standard_normal((4, 3000)).astype(np.float32)
    x[0, 17] = np.nan
    x[1, 99] = np.inf
    x[2, :] = -np.inf
    for temperature, k, p in [(1.0, 0, 0.9), (1.0, 40, 0.8), (0.7, 5, 1.0)]:
        got = Sampler(temperature, k, p).probs(x)
        assert np.array_equal(got, reference_probs(x, temperature, k, p), equal_nan=True)
        assert np.array_equal(top_p_mask(x.astype(np.float64), p), reference_top_p_mask(x.astype(np.float64), p))


class _CountingNumpy:
    """numpy, with the length of each row np.argsort / np.sort is asked to order recorded."""

    def __init__(self):
        self.sorted = []

    def __getattr__(self, name):
        return getattr(np, name)

    def argsort(self, a, *args, **kwargs):
        self.sorted.append(np.shape(a)[-1])
        return np.argsort(a, *args, **kwargs)

    def sort(self, a, *args, **kwargs):
        self.sorted.append(np.shape(a)[-1])
        return np.sort(a, *args, **kwargs)


@pytest.mark.parametrize("k, p", [(0, 0.9), (50, 1.0), (40, 0.95), (0, 0.5)])
def test_no_step_sorts_a_large_vocabulary(monkeypatch, k, p):
    """At V = 250k with a language-model-like distribution, only small candidate sets are sorted."""
    import edgelin.runtime.sampling as sampling

    counting = _CountingNumpy()
    monkeypatch.setattr(sampling, "np", counting)
    logits = (np.random.default_rng(8).standard_normal((2, 250_000)) * 3).astype(np.float32)
    s = Sampler(0.8, k, p, seed=0)
    ids = s(logits, s.rng())
    assert ids.shape == (2,)
    assert max(counting.sorted, default=0) <= 10_000, counting.sorted


def test_a_flat_distribution_still_gets_its_large_nucleus():
    """When the nucleus is most of the vocabulary, the row is sorted whole, and the answer is still right."""
    x = np.random.default_rng(9).standard_normal((1, 100_000)) * 1e-2
    mask = top_p_mask(x, 0.9)
    assert np.array_equal(mask, reference_top_p_mask(x, 0.9))
    assert 0.89 * 100_000 < mask.sum() < 0.91 * 100_000
