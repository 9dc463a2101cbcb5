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
