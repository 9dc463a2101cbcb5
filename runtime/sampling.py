"""Choosing the next token from logits: greedy, temperature, top-k, top-p; seeded with a numpy Generator.

Everything works on a batch: logits [B, V] -> token ids [B].

No step sorts the whole vocabulary when it need not. Top-k is a partition (the k-th largest value, O(V)).
Top-p sorts only a candidate set that provably holds the nucleus: the m most likely tokens (with every
token tied with the m-th), m growing 4x from 1024 until their mass reaches top_p, or, with top-k, the
tokens at least as likely as the least likely of the top k. Only where the nucleus is a large share of the
vocabulary (a flat distribution) is the whole row sorted, as it always was. The kept tokens, the
probabilities and the seeded draws are bit for bit those of a full sort (tests/runtime/test_sampling.py
keeps the full-sort implementation as the reference; scripts/sampling_cost.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401  -- numpy imports it lazily; pay that here, not in time-to-first-token

from edgelin.runtime.options import check_int, check_number

FIRST_CANDIDATES = 1024  # top-p: the first candidate set; then 4x more per round
GROWTH = 4
# top-p: a candidate set is enough once its mass reaches top_p + MARGIN. np.cumsum adds in rank order, so a
# token ranked after the set has "mass before it" (cumsum - its probability, as the full sort computes it)
# >= the set's mass less a few float64 ulps of 1 (< 1e-15): it is provably outside the nucleus. MARGIN
# is far above those ulps; a set short of it only costs another round.
MARGIN = 1e-12


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """True where a token is among the k largest logits of its row (k = 0: keep all). [B, V] -> bool [B, V]"""
    if k <= 0 or k >= logits.shape[-1]:
        return np.ones(logits.shape, dtype=bool)
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]  # [B, 1] the k-th largest value, O(V)
    return logits >= kth  # ties with the k-th value are kept


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """True for the smallest set of most likely tokens whose probability reaches p (nucleus). [B, V] -> bool [B, V]

    Ranked by probability, ties in the order of the vocabulary; a token is kept while the probability
    of the tokens ranked above it is below p, so the most likely token is always kept and the mask is
    never empty.
    """
    if p >= 1.0:
        return np.ones(logits.shape, dtype=bool)
    return _nucleus_mask(softmax(logits), p, None)


def _nucleus_mask(probs: np.ndarray, p: float, within: np.ndarray | None) -> np.ndarray:
    """top_p_mask from probabilities [..., V]; given ``within`` (bool, same shape), a mask that is right
    wherever ``within`` is True (all that ``within & top_p_mask`` needs; it lets top-k bound the candidates)."""
    V = probs.shape[-1]
    rows = probs.reshape(-1, V)
    inside = None if within is None else within.reshape(-1, V)
    mask = np.zeros(rows.shape, dtype=bool)
    for r in range(rows.shape[0]):
        mask[r, _nucleus(rows[r], p, None if inside is None else inside[r])] = True
    return mask.reshape(probs.shape)


def _ranked(probs: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """candidates (ascending ids) in rank order: most likely first, ties in vocabulary order."""
    return candidates[np.argsort(-probs[candidates], kind="stable")]


def _kept(probs: np.ndarray, order: np.ndarray, p: float) -> np.ndarray:
    """The ids of ``order`` (a prefix of the rank order) that are in the nucleus."""
    ranked = probs[order]
    before = np.cumsum(ranked) - ranked  # probability mass of the tokens ranked above; the first has 0
    return order[before < p]


def _nucleus(probs: np.ndarray, p: float, inside: np.ndarray | None) -> np.ndarray:
    """Ids of one row's nucleus ([V] probabilities); given ``inside`` (bool [V]), only its members need be right."""
    V = probs.shape[0]
    if np.isnan(probs).any():  # the full sort decides what NaN does, as it always did
        return _kept(probs, np.argsort(-probs, kind="stable"), p)
    members = None if inside is None else int(np.count_nonzero(inside))
    m = FIRST_CANDIDATES
    while 2 * m <= V:
        if members is not None and members <= m:
            # every token of `inside` has probability >= its least likely one's; that set is a prefix
            # of the rank order (ties included) holding all of `inside`, whatever mass it has
            return _kept(probs, _ranked(probs, np.flatnonzero(probs >= probs[inside].min())), p)
        t = np.partition(probs, V - m)[V - m]  # the m-th largest probability
        order = _ranked(probs, np.flatnonzero(probs >= t))  # m tokens or more (all ties with t): a prefix
        ranked = probs[order]
        cdf = np.cumsum(ranked)
        if cdf[-1] >= p + MARGIN:  # every token ranked after the set is outside the nucleus
            return order[cdf - ranked < p]
        m *= GROWTH
    return _kept(probs, np.argsort(-probs, kind="stable"), p)  # a large share of V: sort the row


def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class Sampler:
    """temperature 0 = greedy (argmax); top_k 0 = off; top_p 1 = off; seed None = fresh entropy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, low=0, high=100, hint="0 = greedy")
        check_int("top_k", self.top_k, low=0, hint="0 = off")
        check_number("top_p", self.top_p, low=0, high=1, open_low=True, hint="1 = off")
        if self.seed is not None:
            check_int("seed", self.seed, low=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The distribution sampled from: logits [B, V] -> float64 probabilities [B, V] (zeros where masked)."""
        with np.errstate(over="ignore"):
            x = logits.astype(np.float64) / self.temperature
        if not np.isfinite(x).all() and np.isfinite(logits).all():
            # a temperature so small (e.g. 1e-310) that logits / T overflow to +-inf: divide the distances to
            # each row's largest logit instead -- 0 at the top, -inf (probability 0) where it is far below --
            # which is the limit the distribution tends to (greedy, ties shared), not NaN
            with np.errstate(over="ignore"):
                l = logits.astype(np.float64)
                x = (l - l.max(axis=-1, keepdims=True)) / self.temperature
        keep = top_k_mask(x, self.top_k)
        top = x.max(axis=-1, keepdims=True)
        if not np.isfinite(top).all():  # NaN, +inf, or a row of -inf: as it always did, whatever that gives
            return softmax(np.where(keep & top_p_mask(x, self.top_p), x, -np.inf))
        # The kept tokens always include each row's largest logit, so the masked softmax below has the
        # same maximum, and exp once serves both softmaxes (exp(-inf) = 0 where masked).
        e = np.exp(x - top)
        if self.top_p < 1.0:
            within = keep if 0 < self.top_k < x.shape[-1] else None
            keep &= _nucleus_mask(e / e.sum(axis=-1, keepdims=True), self.top_p, within)
        e = np.where(keep, e, 0.0)
        return e / e.sum(axis=-1, keepdims=True)

    def __call__(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """logits [B, V] -> token ids int64 [B]."""
        if self.greedy:
            return logits.argmax(axis=-1).astype(np.int64)
        cdf = np.cumsum(self.probs(logits), axis=-1)  # [B, V]
        u = rng.random(cdf.shape[0]) * cdf[:, -1]  # [B]
        ids = (cdf <= u[:, None]).sum(axis=-1)  # first index whose cdf exceeds u
        return np.minimum(ids, cdf.shape[-1] - 1).astype(np.int64)


__all__ = ["Sampler", "softmax", "top_k_mask", "top_p_mask"]
