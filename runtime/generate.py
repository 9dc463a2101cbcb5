"""Streaming generation: prompts in, tokens out as they are produced.

    gen = Generator(session, "Once upon a time", max_new_tokens=64, temperature=0.8, seed=1)
    for tok in gen:                      # Token(seq, id, text)
        print(tok.text, end="", flush=True)
    gen.stats, gen.results, gen.state    # timings, per-prompt text and ids, the state after it all

A batch of prompts is prefilled together, right-padded, one prefill call per piece of ``prefill_chunk``
tokens for each group of prompts of similar lengths (``RAGGED_MAX_PADDING``), when the export's prefill graph
takes per-row lengths (``Session.prefill_batch``; each row's state is that of its prompt alone), else each
prompt alone and the states stacked; then the batch is decoded together. A sequence that finishes (any of the
eos ids, a stop sequence, max_new_tokens) leaves the batch after its last token has gone through the model, so
``gen.state`` continues every sequence exactly where its text ends.

The generation controls follow Hugging Face ``generate``: ``repetition_penalty`` (CTRL: the logit of every id
already in the sequence -- its prompt and what was generated since -- is divided by the penalty where it is
positive and multiplied by it where it is negative), ``no_repeat_ngram_size`` (n: an id that would complete an
n-gram already in the sequence is banned), ``min_new_tokens`` (every eos id is masked until that many tokens were
generated), then temperature, top-k and top-p (``Sampler``). ``process_logits`` is that first step alone.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from edgelin.errors import ManifestError, NonFiniteError, RuntimeInputError
from edgelin.runtime.controls import NGrams, StopStrings, process_logits
from edgelin.runtime.files import check_output_file
from edgelin.runtime.manifest import PREFILL_PIECE
from edgelin.runtime.sampling import Sampler
from edgelin.runtime.session import Session, load
from edgelin.runtime.state import State, check_state_for, is_state_file
from edgelin.runtime.tokenizer import StreamDecoder
from edgelin.runtime.options import check_int, check_number, token_array


MAX_NEW_TOKENS = 1_000_000  # a sane cap: the state is constant-size, but a typo like 1e12 should not run for days


DEFAULT_PREFILL_CHUNK = PREFILL_PIECE  # the manifest's recommended prefill piece, written by the exporter


# A batch of prompts is prefilled in ragged calls of at most this much padded work per real token
# (Session.prefill_batch's max_padding). Measured on the bundled model, 8 prompts, CPU, best of 3: lengths
# 12-512 in one call took 2.0-2.6x the time of one prompt at a time (1 and 2 threads), grouped at 1.25 1.1x;
# lengths 17-31 took 0.7-0.8x in one call or grouped at 1.25 (fewer calls); lengths 200-256 0.9-1.0x.
RAGGED_MAX_PADDING = 1.25


MAX_PENALTY = 100.0


MAX_NGRAM = 4096  # no_repeat_ngram_size: a longer n-gram is a typo (each step hashes n - 1 ids)


@dataclass(frozen=True)
class Token:
    seq: int  # index of the prompt this token continues
    id: int  # token id
    text: str  # text released by this token ("" while a partial character or a possible stop sequence is held back)


@dataclass
class Stats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    first_token_s: float = math.nan  # from the start of the call to the first token: time to first token
    new_tokens: int = 0  # tokens produced, all sequences together
    decode_tokens: int = 0  # of those, produced by decode steps (the first of each sequence comes from prefill)
    decode_s: float = 0.0  # from the first token to the last

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else math.nan

    def to_dict(self) -> dict[str, float]:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "time_to_first_token_s": self.first_token_s, "prefill_s": self.prefill_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens": self.decode_tokens,
            "decode_s": self.decode_s, "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass
class Result:
    """One prompt's continuation."""

    text: str = ""
    ids: list[int] = field(default_factory=list)  # every token produced (an eos is not included)
    stop_reason: str | None = None  # "eos", "stop" (a stop sequence) or "length"
    eos_id: int | None = None  # the eos id that ended it (the state has seen it; ids do not hold it)


class _Sequence:
    """Per-prompt bookkeeping: decoded text, held-back text that may start a stop sequence, the reason to stop."""

    def __init__(self, decoder: StreamDecoder | None, stop: StopStrings, prompt: np.ndarray, track: bool, ngram: int = 0) -> None:
        self.result = Result()
        self.decoder, self.stop = decoder, stop
        self.matcher = stop.matcher()
        self.held = ""  # decoded text not yet released
        # the distinct ids of the sequence so far (prompt + generated), for the repetition penalty
        self._seen: dict[int, None] | None = dict.fromkeys(prompt.tolist()) if track else None
        self._seen_array: np.ndarray | None = None
        self.ngrams = NGrams(ngram, prompt.tolist()) if ngram else None  # for no_repeat_ngram_size

    def seen(self) -> np.ndarray:
        """The distinct ids of the prompt and of every generated token (int64 [N])."""
        if self._seen_array is None:
            self._seen_array = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
        return self._seen_array

    def push(self, token_id: int, eos_ids: frozenset[int], max_new: int) -> str:
        """Record one new token; returns the text it releases, and sets result.stop_reason when done."""
        r = self.result
        if self._seen is not None and token_id not in self._seen:
            self._seen[token_id] = None
            self._seen_array = None
        if self.ngrams is not None:
            self.ngrams.add(token_id)
        if token_id in eos_ids:
            r.stop_reason, r.eos_id = "eos", token_id
            if self.decoder is not None:
                self.held += self.decoder.flush()
            return self._release(len(self.held))
        r.ids.append(token_id)
        new = self.decoder.feed(token_id) if self.decoder is not None else ""
        self.held += new
        if len(r.ids) >= max_new:
            r.stop_reason = "length"
        hit = self.matcher.feed(new) if self.stop.stops and new else None
        if hit is not None:  # the text ends before the stop string (the held text held no whole one before this token)
            j, end = hit
            r.stop_reason = "stop"
            text = self.held[: len(self.held) - len(new) + end - len(self.stop.stops[j])]
            self.held = ""
            r.text += text
            return text
        if r.stop_reason is not None:  # eos / length: everything goes out, partial characters too
            if self.decoder is not None:
                self.held += self.decoder.flush()
            return self._release(len(self.held))
        return self._release(len(self.held) - self.matcher.partial())

    def _release(self, n: int) -> str:
        text, self.held = self.held[:n], self.held[n:]
        self.result.text += text
        return text


def _check_options(max_new_tokens: Any, prefill_chunk: Any, stop: Any, repetition_penalty: Any = 1.0, min_new_tokens: Any = 0,
                   no_repeat_ngram_size: Any = 0) -> list[str]:
    check_int("max_new_tokens", max_new_tokens, low=0, high=MAX_NEW_TOKENS)
    check_int("prefill_chunk", prefill_chunk, low=1)
    check_number("repetition_penalty", repetition_penalty, low=0, high=MAX_PENALTY, open_low=True, hint="1 = off; 1.1-1.3 discourages repeats")
    check_int("min_new_tokens", min_new_tokens, low=0, high=MAX_NEW_TOKENS, hint="eos is masked until this many tokens were generated")
    check_int("no_repeat_ngram_size", no_repeat_ngram_size, low=0, high=MAX_NGRAM, hint="0 = off; n bans any id that would repeat an n-gram")
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
        raise RuntimeInputError(f"stop sequences must be non-empty strings, got {stop!r}")
    return list(stop)


class Generator:
    """An iterator of ``Token`` for one prompt or a batch of prompts (text, or token ids).

    prompts: a str, a list of str, a sequence of ids, or a list of id sequences.
    state: continue from this state (batch = number of prompts) instead of a fresh one; it is
        consumed -- ``fork()`` it first to keep it. The state after generation is ``gen.state``.
    max_new_tokens: tokens to produce per prompt at most; stop: strings that end a sequence (not included
    in its text); eos_id: a token id, or a list of them, that ends a sequence (default: the manifest's, every
    id of its eos_ids); min_new_tokens: no eos before this many tokens (Hugging Face's min_new_tokens);
    repetition_penalty: Hugging Face's (CTRL) penalty over the ids of the sequence so far, this prompt and what
    it generated (a state passed in carries no ids: what came before it is not penalised); 1 = off;
    no_repeat_ngram_size: Hugging Face's -- no n-gram of that size occurs twice in the sequence (the prompt and what
    it generated, as for the penalty); 0 = off;
    temperature / top_k / top_p / seed: see ``Sampler``; prefill_chunk: the longest piece of prompt
    run through the prefill graph at once (default: the manifest's prefill_piece).
    """

    def __init__(
        self,
        session: Session,
        prompts: Any,
        *,
        state: State | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        eos_id: int | Sequence[int] | None = None,
        prefill_chunk: int | None = None,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
    ) -> None:
        if prefill_chunk is None:  # the export's recommended prefill piece (manifest), else the runtime's default
            prefill_chunk = getattr(getattr(session, "manifest", None), "prefill_piece", DEFAULT_PREFILL_CHUNK)
        stop = _check_options(max_new_tokens, prefill_chunk, stop, repetition_penalty, min_new_tokens, no_repeat_ngram_size)
        if not hasattr(session, "vocab_size"):
            raise RuntimeInputError(f"Generator takes a Session (edgelin.runtime.load(export_dir)), got {type(session).__name__}")
        self.session = session
        self.sampler = Sampler(temperature, top_k, top_p, seed)
        self.max_new_tokens, self.prefill_chunk = int(max_new_tokens), int(prefill_chunk)
        self.repetition_penalty, self.min_new_tokens = float(repetition_penalty), int(min_new_tokens)
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)
        texts, self.prompt_ids = self._encode(prompts)
        tokenizer = session.tokenizer if texts or stop else _optional_tokenizer(session)  # text needs a tokenizer
        self.eos_ids = _eos_set(eos_id) if eos_id is not None else _manifest_eos(session, tokenizer)
        if state is not None:
            check_state_for(state, len(self.prompt_ids))
        self._in_state = state
        track = self.repetition_penalty != 1.0
        stops = StopStrings(stop)  # built once, shared by the sequences
        self._seqs = [_Sequence(tokenizer.decoder() if tokenizer else None, stops, p, track, self.no_repeat_ngram_size)
                      for p in self.prompt_ids]
        self.stats = Stats(prompt_tokens=sum(len(p) for p in self.prompt_ids))
        self._iter = self._run()
        self._done = False
        self._final: dict[int, State] = {}  # sequence -> its state after its last token
        self._running: tuple[State, list[int], np.ndarray | None] | None = None  # state, its sequences, their unfed tokens
        self._after: State | None = None

    def _encode(self, prompts: Any) -> tuple[bool, list[np.ndarray]]:
        """(prompts were text, one int64 [T] array per prompt), every id inside the vocabulary."""
        if isinstance(prompts, (bytes, bytearray, memoryview)):
            raise RuntimeInputError(f"the prompt is {type(prompts).__name__}, which is neither text nor token ids; decode it to text "
                                    "(data.decode('utf-8')) and pass the text")
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, np.ndarray) and prompts.ndim == 1 or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, (int, np.integer)) for p in prompts)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple, np.ndarray)) or len(prompts) == 0:
            raise RuntimeInputError("no prompt given: pass a string, a list of strings, or token ids")
        texts = [isinstance(p, str) for p in prompts]
        if any(texts) and not all(texts):
            raise RuntimeInputError("mix of text and token-id prompts; pass one kind")
        out = []
        for i, p in enumerate(prompts):
            if texts[0]:
                ids = self.session.tokenizer.encode(p)
            else:
                ids = token_array(p, f"prompt {i}", self.session.vocab_size)
            if ids.ndim != 1 or ids.size == 0:
                raise RuntimeInputError(f"prompt {i} is empty" if ids.size == 0 else f"prompt {i} must be a flat sequence of token ids")
            if not np.issubdtype(ids.dtype, np.integer):
                raise RuntimeInputError(f"prompt {i} must hold integer token ids, got {ids.dtype}")
            bad = np.flatnonzero((ids < 0) | (ids >= self.session.vocab_size))
            if bad.size:
                raise RuntimeInputError(
                    f"token id {int(ids[bad[0]])} at position {int(bad[0])} of prompt {i} is outside the vocabulary [0, {self.session.vocab_size})"
                )
            out.append(ids.astype(np.int64))
        return texts[0], out

    # ---- iteration -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Token]:
        return self

    def __next__(self) -> Token:
        return next(self._iter)

    @property
    def results(self) -> list[Result]:
        return [s.result for s in self._seqs]

    @property
    def text(self) -> str:
        """The generated text of the first (or only) prompt."""
        return self._seqs[0].result.text

    def run(self) -> "Generator":
        """Consume the whole stream (when you do not need tokens one by one)."""
        for _ in self:
            pass
        return self

    def _run(self) -> Iterator[Token]:
        session, n = self.session, len(self.prompt_ids)
        start = time.perf_counter()
        if n == 1:  # batch 1 continues in place
            state = session.new_state(1) if self._in_state is None else self._in_state
            logits = session.prefill(self.prompt_ids[0][None], state, chunk=self.prefill_chunk, last_only=True)  # [1, V]
        else:  # all prompts in one prefill call per piece where the export takes lengths, else one by one
            logits, state = session.prefill_batch(
                self.prompt_ids, self._in_state, chunk=self.prefill_chunk, max_padding=RAGGED_MAX_PADDING,
            )  # [n, V]
        self.stats.prefill_s = time.perf_counter() - start
        _check_finite(logits, "after the prompt (prefill)", list(range(n)))
        rows = list(range(n))  # sequence index of each batch row
        rng = self.sampler.rng()
        if self.max_new_tokens == 0:
            self._finish(state, rows, None)
            return
        first, step = None, 0
        while True:
            if self.repetition_penalty != 1.0 or self.min_new_tokens > 0 or self.no_repeat_ngram_size:
                seqs = [self._seqs[seq] for seq in rows]
                logits = process_logits(
                    logits, [s.seen() for s in seqs] if self.repetition_penalty != 1.0 else [], [len(s.result.ids) for s in seqs],
                    repetition_penalty=self.repetition_penalty, min_new_tokens=self.min_new_tokens, eos_ids=self.eos_ids,
                    banned=[s.ngrams.banned() for s in seqs] if self.no_repeat_ngram_size else (),
                )
            ids = self.sampler(logits, rng)  # [R]
            now = time.perf_counter()
            if first is None:
                first = now
                self.stats.first_token_s = now - start
            self.stats.decode_s = now - first
            self.stats.new_tokens += len(rows)
            self.stats.decode_tokens = self.stats.new_tokens - n
            for row, seq in enumerate(rows):
                s = self._seqs[seq]
                text = s.push(int(ids[row]), self.eos_ids, self.max_new_tokens)
                if s.result.stop_reason != "eos":
                    yield Token(seq, int(ids[row]), text)
            live = [row for row, seq in enumerate(rows) if self._seqs[seq].result.stop_reason is None]
            if not live:
                self._finish(state, rows, ids)
                return
            logits = session.decode(ids[:, None], state)[:, 0]  # [R, V]; finished rows take in their last token too
            step += 1
            _check_finite(logits[live], f"at decode step {step}", [rows[r] for r in live])
            if len(live) < len(rows):
                done = [row for row in range(len(rows)) if row not in live]
                self._final.update(zip((rows[r] for r in done), state.rows(done).split()))
                state, rows, logits = state.rows(live), [rows[r] for r in live], logits[live]

    def _finish(self, state: State, rows: list[int], pending: np.ndarray | None) -> None:
        self._running = (state, rows, pending)
        self._done = True

    # ---- the state after generation --------------------------------------------------------------
    @property
    def state(self) -> State:
        """The state after every prompt and its generated tokens (eos included), in prompt order.

        The last token of each sequence has not been through the model yet when the stream ends; it is
        fed here, once, on first access (one decode step).
        """
        if not self._done:
            raise RuntimeInputError("the generation has not finished; iterate it to the end (or call .run()) first")
        if self._after is None:
            state, rows, pending = self._running
            if pending is not None:
                self.session.decode(pending[:, None], state)
            if not self._final:  # nobody left early: the batch is still in prompt order
                self._after = state
            else:
                self._final.update(zip(rows, state.split()))
                self._after = State.stack([self._final[i] for i in range(len(self._seqs))])
        return self._after


def _eos_set(eos_id: Any) -> frozenset[int]:
    """eos_id as given to Generator: None, an id, or a sequence of ids -> the set of ids that end a sequence."""
    items = [] if eos_id is None else [eos_id] if isinstance(eos_id, (int, np.integer)) and not isinstance(eos_id, bool) else eos_id
    if not isinstance(items, (list, tuple, np.ndarray, frozenset, set)):
        raise RuntimeInputError(f"eos_id must be a token id or a list of them, got {eos_id!r}")
    return frozenset(check_int("eos_id", i, low=0) for i in items)


def _id_prompts(prompt_ids: Any) -> tuple[bool, list[list[int]]]:
    """(a batch?, the prompts as lists of ints) from one id sequence or a list of them; a one-line error otherwise."""
    if isinstance(prompt_ids, np.ndarray):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (bytes, bytearray, memoryview)):
        raise RuntimeInputError(f"prompt_ids is {type(prompt_ids).__name__}, which are no token ids; pass a list of integer ids, "
                                "or text as the prompt (bytes decoded: data.decode('utf-8'))")
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise RuntimeInputError("prompt_ids must be a non-empty list of token ids (or a list of such lists)")
    batch = not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompt_ids)
    prompts = [list(p) if isinstance(p, (list, tuple, np.ndarray)) else p for p in prompt_ids] if batch else [list(prompt_ids)]
    for n, p in enumerate(prompts):
        if not isinstance(p, list) or not p or not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in p):
            raise RuntimeInputError(f"prompt ids {n + 1} of {len(prompts)} must be a non-empty list of integer token ids, got {p!r}"[:200])
    return batch, [[int(i) for i in p] for p in prompts]


def _check_finite(logits: np.ndarray, when: str, seqs: list[int]) -> None:
    """Stop with an error, not garbage tokens, when the model's logits [R, V] are NaN or infinite."""
    bad = ~np.isfinite(logits).all(axis=-1)  # [R]
    if bad.any():
        seq = seqs[int(np.flatnonzero(bad)[0])]
        raise NonFiniteError(
            f"the logits became NaN/infinite {when} (sequence {seq}); the model or its state has overflowed -- "
            "check the weights (edgelin validate) or start from a fresh state"
        )


def _manifest_eos(session: Session, tokenizer: Any) -> frozenset[int]:
    """Every eos id: the tokenizer's, else the manifest's (an id-only export may name them too)."""
    if tokenizer is not None:
        return frozenset(getattr(tokenizer, "eos_ids", None) or ([] if tokenizer.eos_id is None else [tokenizer.eos_id]))
    spec = getattr(getattr(session, "manifest", None), "tokenizer", None) or {}
    ids = spec.get("eos_ids") or ([] if spec.get("eos_id") is None else [spec["eos_id"]])
    return frozenset(int(i) for i in ids)


def _optional_tokenizer(session: Session):
    try:
        return session.tokenizer
    except ManifestError:  # an id-only model (tokenizer kind "ids" or unknown): tokens carry no text
        return None


# ---- the library function behind `edgelin generate` ----------------------------------------------
def generate_text(
    export: str | os.PathLike | Session,
    prompt: str | Sequence[str] | None = None,
    *,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    max_new_tokens: int = 256,
    repetition_penalty: float = 1.0,
    min_new_tokens: int = 0,
    no_repeat_ngram_size: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    provider: str = "auto",
    threads: int | None = None,
    prefill_chunk: int | None = None,
    state_in: str | os.PathLike | None = None,
    state_out: str | os.PathLike | None = None,
    overwrite: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate a continuation of ``prompt`` and return it with timings.

    ``export`` is an export folder (loaded here) or an open Session. ``prompt_ids`` replaces ``prompt``
    with token ids (one list of ids, or a list of such lists for a batch); the text is then decoded only
    where the export has a tokenizer ("" otherwise; "ids" always holds the generated ids). ``on_text`` is
    called with each piece of text as soon as it is released (one prompt only). ``state_in`` continues a conversation saved
    with ``state_out`` (written atomically, after the generation finished; an existing file is replaced only
    if it is an edgelin state file not part of an export, or with ``overwrite=True``).
    Returns {"text", "ids", "has_text" (False: no tokenizer decoded the ids), "new_tokens", "stop_reason", "provider", "prompt_tokens", "time_to_first_token_s",
    "prefill_tokens_per_s", "decode_tokens_per_s", ..., "load_s", "state_out"}.

    A list of prompts runs as one batch (``Generator``: prompts of similar length prefilled together,
    decode batched; each continuation is that of its prompt alone) and returns "results", one
    {"prompt", "text", "ids", "stop_reason"} per prompt in order, in place of "text", "ids" and "stop_reason";
    the timings and token counts are the batch's. ``state_in`` / ``state_out`` then hold one row per prompt.
    """
    if (prompt is None) == (prompt_ids is None):
        raise RuntimeInputError("give either a text prompt (--prompt) or token ids (--prompt-ids), not both" if prompt is not None
                                else "no prompt given; give some text with --prompt, or token ids with --prompt-ids")
    if prompt_ids is not None:
        batch, prompts = _id_prompts(prompt_ids)
    else:
        if not isinstance(prompt, (str, list, tuple)):  # bytes would read as a batch of numbers, anything else fail in list()
            hint = (": decode it to text (data.decode('utf-8')) and pass the text" if isinstance(prompt, (bytes, bytearray, memoryview))
                    else "; pass a string or a list of strings (token ids go in prompt_ids)")
            raise RuntimeInputError(f"the prompt is {type(prompt).__name__}, not text{hint}")
        batch = not isinstance(prompt, str)
        prompts = list(prompt) if batch else [prompt]
        if not prompts:
            raise RuntimeInputError("no prompt given; give some text with --prompt")
        for i, p in enumerate(prompts):
            where = f"prompt {i + 1} of {len(prompts)}" if batch else "the prompt"
            if not isinstance(p, str):
                raise RuntimeInputError(f"{where} is {type(p).__name__} {str(p)[:40]}, not text; pass strings (token ids go in prompt_ids)")
            if not p:
                raise RuntimeInputError(f"{where} is empty; give some text with --prompt")
    if on_text is not None and not callable(on_text):
        raise RuntimeInputError(f"on_text must be a function that takes each piece of text, got {type(on_text).__name__}")
    if batch and on_text is not None:
        raise RuntimeInputError("on_text streams one prompt; with several, read each continuation from the results")
    Sampler(temperature, top_k, top_p, seed)  # check every option before the (slow) load
    _check_options(max_new_tokens, DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk, stop, repetition_penalty, min_new_tokens,
                   no_repeat_ngram_size)
    if state_out is not None:  # before any work: a bad path must not cost the generated text
        check_output_file(state_out, "state file", overwrite=overwrite, ours=is_state_file)
    t0 = time.perf_counter()
    session = export if isinstance(export, Session) else load(export, provider=provider, threads=threads)
    load_s = time.perf_counter() - t0
    state = session.load_state(state_in, batch=len(prompts)) if state_in is not None else None
    gen = Generator(
        session, prompts if batch else prompts[0], state=state, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, stop=stop, prefill_chunk=prefill_chunk,
        repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens, no_repeat_ngram_size=no_repeat_ngram_size,
    )
    for tok in gen:
        if on_text is not None and tok.text:
            on_text(tok.text)
    if state_out is not None:
        gen.state.save(state_out, overwrite=overwrite)
    if batch:
        texts: dict[str, Any] = {"results": [{"prompt": p, "text": r.text, "ids": list(r.ids), "stop_reason": r.stop_reason}
                                             for p, r in zip(prompts, gen.results)]}
    else:
        texts = {"text": gen.results[0].text, "ids": list(gen.results[0].ids), "stop_reason": gen.results[0].stop_reason}
    has_text = gen._seqs[0].decoder is not None  # the export's tokenizer decoded the ids
    # positions the longest sequence holds at the end (prompt + continuation); a batch's caches are as long as it
    positions = max(len(p) + len(r.ids) for p, r in zip(gen.prompt_ids, gen.results))
    return {**texts, "has_text": has_text, "provider": session.provider, **gen.stats.to_dict(), "load_s": load_s,
            "state_out": str(state_out) if state_out is not None else None,
            # the state's memory now: fixed for a linear model; a hybrid's KV cache grows with the context
            "state_bytes": session.manifest.state_bytes(len(gen.results), positions), "state_grows": session.manifest.grows,
            "state_positions": positions}


__all__ = ["DEFAULT_PREFILL_CHUNK", "MAX_NEW_TOKENS", "Generator", "Result", "Stats", "Token", "generate_text"]
