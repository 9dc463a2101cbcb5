"""Choosing the next token from logits: greedy, temperature, top-k, top-p; seeded with a numpy Generator.

Everything works on a batch: logits [B, V] -> token ids [B].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.random  # noqa: F401  -- numpy imports it lazily; pay that here, not in time-to-first-token

from edgelin.runtime.options import check_int, check_number


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """True where a token is among the k largest logits of its row (k = 0: keep all). [B, V] -> bool [B, V]"""
    if k <= 0 or k >= logits.shape[-1]:
        return np.ones(logits.shape, dtype=bool)
    kth = np.partition(logits, -k, axis=-1)[..., -k, None]  # [B, 1] the k-th largest value
    return logits >= kth  # ties with the k-th value are kept


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """True for the smallest set of most likely tokens whose probability reaches p (nucleus). [B, V] -> bool [B, V]

    The most likely token is always kept, so the mask is never empty.
    """
    if p >= 1.0:
        return np.ones(logits.shape, dtype=bool)
    probs = softmax(logits)
    order = np.argsort(-probs, axis=-1, kind="stable")  # [B, V] most likely first
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(sorted_probs, axis=-1) - sorted_probs  # probability mass of the tokens ranked above
    keep_sorted = before < p  # the first token has before = 0, so it is always kept
    mask = np.zeros(logits.shape, dtype=bool)
    np.put_along_axis(mask, order, keep_sorted, axis=-1)
    return mask


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
        x = logits.astype(np.float64) / self.temperature
        x = np.where(top_k_mask(x, self.top_k) & top_p_mask(x, self.top_p), x, -np.inf)
        return softmax(x)

    def __call__(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """logits [B, V] -> token ids int64 [B]."""
        if self.greedy:
            return logits.argmax(axis=-1).astype(np.int64)
        cdf = np.cumsum(self.probs(logits), axis=-1)  # [B, V]
        u = rng.random(cdf.shape[0]) * cdf[:, -1]  # [B]
        ids = (cdf <= u[:, None]).sum(axis=-1)  # first index whose cdf exceeds u
        return np.minimum(ids, cdf.shape[-1] - 1).astype(np.int64)


__all__ = ["Sampler", "softmax", "top_k_mask", "top_p_mask"]
