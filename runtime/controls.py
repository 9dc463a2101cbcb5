"""Hugging Face generate's controls, as both runtimes apply them: the logits processors (repetition penalty, min new
tokens, the n-gram ban) and stop strings found in streamed text in linear time."""

from __future__ import annotations

from array import array
from typing import Sequence

import numpy as np


class NGrams:
    """The n-grams of a growing sequence, for Hugging Face's ``no_repeat_ngram_size``: ``banned()`` is the ids that
    would complete an n-gram the sequence already holds (the ids that followed each earlier occurrence of its last
    n - 1 ids; for n = 1 every id seen). One step costs O(n), not a scan of the sequence."""

    def __init__(self, n: int, ids: Sequence[int] = ()) -> None:
        self.n, self.ids = int(n), []
        self._next: dict[tuple[int, ...], dict[int, None]] = {}  # (n - 1)-gram -> the ids seen after it, in order
        for i in ids:
            self.add(int(i))

    def add(self, token_id: int) -> None:
        self.ids.append(token_id)
        if len(self.ids) >= self.n:
            self._next.setdefault(tuple(self.ids[len(self.ids) - self.n:-1]), {})[token_id] = None

    def banned(self) -> list[int]:
        if len(self.ids) + 1 < self.n:
            return []
        return list(self._next.get(tuple(self.ids[len(self.ids) - self.n + 1:]), ()))


class StopStrings:
    """Stop strings found in a text that arrives piece by piece, in time linear in the text and the strings.

    Each string gets Knuth-Morris-Pratt's table once (``prefix``: for each length k of its start, the longest
    proper start of it that also ends those k characters); a ``Matcher`` then advances one state per string and
    character -- how many characters of the string's start the text ends with -- which is also how much text
    must be held back while it may still become that string. A search over the held text with every start
    of every string tried at every token costs the square of the strings' lengths per token instead."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.prefix = [_prefix_table(s) for s in self.stops]

    def matcher(self) -> "Matcher":
        return Matcher(self)


def _prefix_table(s: str) -> array:
    table = array("q", [0]) * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


class Matcher:
    """One sequence's progress through ``StopStrings``."""

    def __init__(self, stops: StopStrings) -> None:
        self.stops = stops
        self.state = [0] * len(stops.stops)  # per string: how many of its first characters the text ends with

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over ``text``. Returns (the string's index, where it ends in ``text``) for the first string in
        the list that is complete somewhere in it (its first occurrence), or None."""
        hit = None
        for j, (s, table) in enumerate(zip(self.stops.stops, self.stops.prefix)):
            k = self.state[j]
            for i, c in enumerate(text):
                while k and c != s[k]:
                    k = table[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):
                    if hit is None:
                        hit = (j, i + 1)
                    k = table[k - 1]
                    break
            self.state[j] = k
            if hit is not None:
                return hit
        return None

    def partial(self) -> int:
        """How many characters at the end of the text so far may still start a stop string."""
        return max(self.state, default=0)


def process_logits(logits: np.ndarray, seen: Sequence[np.ndarray], new_tokens: Sequence[int], *,
                   repetition_penalty: float = 1.0, min_new_tokens: int = 0, eos_ids: frozenset[int] | Sequence[int] = (),
                   banned: Sequence[Sequence[int]] = ()) -> np.ndarray:
    """Hugging Face ``generate``'s logits processors, before sampling: logits [R, V] -> a processed copy.

    seen[r]: the distinct ids of row r's sequence so far (``RepetitionPenaltyLogitsProcessor``: each one's logit
    divided by the penalty where it is positive, multiplied where it is negative -- in the logits' dtype);
    new_tokens[r]: tokens row r has generated so far (``MinNewTokensLengthLogitsProcessor``: below
    ``min_new_tokens`` every eos id's logit is -inf); banned[r]: ids that would repeat an n-gram of row r
    (``NoRepeatNGramLogitsProcessor``, ``NGrams.banned``: their logits are -inf)."""
    out = np.array(logits, copy=True)
    if repetition_penalty != 1.0:
        penalty = out.dtype.type(repetition_penalty)
        for row, ids in enumerate(seen):
            x = out[row, ids]
            out[row, ids] = np.where(x < 0, x * penalty, x / penalty)
    if min_new_tokens > 0 and eos_ids:
        eos = np.fromiter(sorted(eos_ids), dtype=np.int64)
        eos = eos[eos < out.shape[-1]]
        for row, n in enumerate(new_tokens):
            if n < min_new_tokens:
                out[row, eos] = -np.inf
    for row, ids in enumerate(banned):
        if len(ids):
            out[row, np.asarray(ids, dtype=np.int64)] = -np.inf
    return out


__all__ = ["Matcher", "NGrams", "StopStrings", "process_logits"]
