"""Tokenizers the runtime knows, chosen by the manifest's ``tokenizer`` entry (its ``kind``).

``bytes``: text as its UTF-8 bytes (ids 0..255 + offset). A streamed byte may end in the middle of a
multi-byte character, so decoding goes through an incremental decoder that holds the partial character
back until it is complete, and replaces invalid bytes with U+FFFD.

``huggingface``: a checkpoint's ``tokenizer.json``, copied into the export folder (its sha256 in the
manifest), run by the ``tokenizers`` package (Rust, torch-free; imported only for such an export). Text is
encoded without the tokenizer's post-processor and the manifest's ``bos_id`` is prepended when ``add_bos``
says so; text is decoded as ``tokenizers`` decodes it (special tokens skipped where the manifest's
``skip_special_tokens`` says so). Streaming (``HuggingFaceStreamDecoder``) releases exactly the new suffix of
that decoding: never a U+FFFD that the whole sequence's decoding will not contain.
"""

from __future__ import annotations

import codecs
import os
import re
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.files import regular_file
from edgelin.runtime.manifest import HUGGINGFACE, TOKENIZER_FILES, file_sha256
from edgelin.runtime.options import check_int, token_array

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None
    eos_ids: tuple[int, ...]  # every id that ends a sequence (eos_id first); () when none

    def encode(self, text: str) -> np.ndarray: ...  # int64 [T]

    def decode(self, ids: Iterable[int]) -> str: ...

    def decoder(self) -> "StreamDecoder": ...


class StreamDecoder(Protocol):
    def feed(self, token_id: int) -> str: ...  # the text completed by this token ("" if held back)

    def flush(self) -> str: ...  # whatever is still held back, replaced where incomplete


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + offset (the manifest's ``offset``, usually 0), no special tokens
    unless the manifest names an eos.

    A prompt from the command line whose bytes are not valid UTF-8 (Python hands them over as lone
    surrogates U+DC80..U+DCFF) is encoded as those raw bytes: a byte model reads any bytes. Any other
    lone surrogate is not text and raises RuntimeInputError.
    """

    vocab_size = 256

    def __init__(self, eos_id: int | None = None, offset: int = 0, eos_ids: Iterable[int] | None = None) -> None:
        self.eos_id = eos_id
        self.eos_ids = _eos_ids(eos_id, eos_ids)
        self.offset = offset

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise RuntimeInputError(f"the prompt must be text (str), got {type(text).__name__}")
        try:
            # surrogateescape: bytes of a command-line argument that were not UTF-8 come back as those bytes
            data = text.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError as exc:
            raise RuntimeInputError(
                f"the prompt holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not text; "
                "pass valid Unicode text"
            ) from None
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64) + self.offset  # [T]

    def decode(self, ids: Iterable[int]) -> str:
        dec = self.decoder()
        return "".join(dec.feed(i) for i in _ids_to_decode(ids)) + dec.flush()

    def decoder(self) -> "ByteStreamDecoder":
        return ByteStreamDecoder(self.offset)


class ByteStreamDecoder:
    """Feeds one byte id at a time; returns only complete characters. Ids that are no byte decode as U+FFFD."""

    def __init__(self, offset: int = 0) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = offset

    def feed(self, token_id: int) -> str:
        token_id = _one_id(token_id) - self.offset
        if not 0 <= token_id < 256:
            return self._utf8.decode(b"", final=True) + REPLACEMENT  # end any partial char, then mark the bad id
        return self._utf8.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def _ids_to_decode(ids: Any) -> list[int]:
    """The ids given to ``decode`` as a list of ints; a one-line error for what is no flat sequence of ids."""
    if not isinstance(ids, (list, tuple, np.ndarray, str, bytes, bytearray, memoryview)) and ids is not None:
        try:
            ids = list(ids)  # any other iterable of ids (a generator, a range)
        except TypeError:
            raise RuntimeInputError(f"decode takes a sequence of token ids, got {type(ids).__name__}") from None
    array = token_array(ids, "the ids to decode")
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise RuntimeInputError(f"decode takes a flat sequence of integer token ids, got {str(ids)[:60]}")
    return [int(i) for i in array.tolist()]


def _one_id(token_id: Any) -> int:
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
        raise RuntimeInputError(f"a token id is an integer, got {type(token_id).__name__} {str(token_id)[:40]}")
    return int(token_id)


def _eos_ids(eos_id: int | None, eos_ids: Iterable[int] | None) -> tuple[int, ...]:
    ids = tuple(int(i) for i in eos_ids) if eos_ids is not None else (() if eos_id is None else (int(eos_id),))
    if eos_id is not None and eos_id not in ids:
        ids = (int(eos_id),) + ids
    return ids


def _lone_surrogate(text: str) -> RuntimeInputError | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return RuntimeInputError(
            f"the prompt holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not text; pass valid Unicode text"
        )
    return None


TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_BYTES = 1 << 30  # the largest tokenizer file read (a 250k-entry BPE tokenizer.json is ~20 MB)
HF_FILES = TOKENIZER_FILES  # the files of a Hugging Face tokenizer an export may carry; tokenizer.json is the one read
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")  # SentencePiece's byte-fallback tokens


def import_tokenizers():
    """The ``tokenizers`` package, or a one-line error saying how to get it."""
    try:
        import tokenizers
    except ImportError:
        raise RuntimeInputError(
            "this export's tokenizer (tokenizer.json) needs the `tokenizers` package: pip install tokenizers "
            "(or pass token ids instead of text)"
        ) from None
    return tokenizers


def read_hf_tokenizer(path: str | os.PathLike, error: type[Exception] = ManifestError, hint: str = "re-export the model"):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file; ``error`` (one line, ending in ``hint``) when it
    is missing or is not a tokenizer the package reads."""
    tokenizers = import_tokenizers()
    path = Path(path)
    if not path.is_file() and not path.exists():
        raise error(f"{path} does not exist; {hint}")
    try:
        regular_file(path, TOKENIZER_BYTES, "tokenizer file")  # a FIFO would block it, a huge file fill the memory
    except RuntimeInputError as exc:
        raise error(f"{exc}; {hint}") from None
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises Exception with its parser's message
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise error(f"{path} is not a tokenizer.json the `tokenizers` package can read ({first[:200]}); {hint}") from None


def tokenizer_id_range(tok) -> tuple[int, str]:
    """(the largest id the tokenizer can produce or decode, that token's text), added tokens included."""
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
        return -1, ""
    token, top = max(vocab.items(), key=lambda kv: kv[1])
    return top, token


class HuggingFaceTokenizer:
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` package.

    ``encode`` = the tokenizer's ids for the text without its post-processor's special tokens, ``bos_id`` first
    when ``add_bos``; ``decode`` = ``tokenizers``' own decoding (``skip_special_tokens`` as the manifest says).
    """

    def __init__(
        self, tokenizer, *, vocab_size: int, bos_id: int | None = None, eos_id: int | None = None,
        eos_ids: Iterable[int] | None = None, pad_id: int | None = None, add_bos: bool = False, skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.eos_ids = _eos_ids(eos_id, eos_ids)
        self.add_bos, self.skip_special_tokens = bool(add_bos), bool(skip_special_tokens)
        if self.add_bos and bos_id is None:
            raise ManifestError("the tokenizer says add_bos but names no bos_id; re-export the model")
        # ids whose text can still change with the ids after them, held back while they end the sequence: byte-
        # fallback pieces (<0xNN>; a run of them decodes as one group) and skipped special tokens (which decode to
        # nothing, so the pieces on both sides of one form one group)
        self._held = np.zeros(vocab_size, dtype=bool)
        if '"ByteFallback"' in tokenizer.to_str():
            for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
                if 0 <= i < vocab_size and BYTE_PIECE.match(token):
                    self._held[i] = True
        if self.skip_special_tokens:
            for i, added in tokenizer.get_added_tokens_decoder().items():
                if 0 <= i < vocab_size and added.special:
                    self._held[i] = True

    @classmethod
    def from_file(cls, path: str | os.PathLike, **kwargs) -> "HuggingFaceTokenizer":
        return cls(read_hf_tokenizer(path), **kwargs)

    @property
    def tokenizer(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> np.ndarray:
        if not isinstance(text, str):
            raise RuntimeInputError(f"the prompt must be text (str), got {type(text).__name__}")
        bad = _lone_surrogate(text)
        if bad is not None:
            raise bad
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.bos_id] + ids
        return np.asarray(ids, dtype=np.int64).reshape(-1)  # [T]

    def decode(self, ids: Iterable[int]) -> str:
        ids = _ids_to_decode(ids)
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise RuntimeInputError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return self._decode(ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def held_back(self, token_id: int) -> bool:
        """Whether the text of ``token_id`` at the end of a sequence may still change with the next ids."""
        return 0 <= token_id < self.vocab_size and bool(self._held[token_id])

    def decoder(self) -> "HuggingFaceStreamDecoder":
        return HuggingFaceStreamDecoder(self)


class HuggingFaceStreamDecoder:
    """Incremental text of a growing id sequence: what each new id adds to the tokenizer's decoding.

    The text released so far is always the decoding of a prefix of the ids, ``decode(ids[:read])``. A new id
    releases ``decode(ids[:k])`` minus what was released, for the longest ``k`` whose decoding is final: not
    while the text ends in U+FFFD (a UTF-8 character split across byte-level tokens), not inside a trailing run
    of byte-fallback pieces (``<0xNN>``, which decode as one group) and skipped special tokens. Only a window of the ids is decoded each
    time (from the previous release point, where the text so far is not empty, so a decoder's treatment of the
    first token -- SentencePiece's leading space -- is the same in both decodings it compares).
    """

    def __init__(self, tokenizer: HuggingFaceTokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window decoded each time begins here
        self.read = 0  # ids[:read] have been released

    def _window(self, end: int) -> str:
        return self.tok._decode(self.ids[self.start:end])

    def feed(self, token_id: int) -> str:
        token_id = _one_id(token_id)
        if not 0 <= token_id < self.tok.vocab_size:
            raise RuntimeInputError(f"token id {token_id} is outside the vocabulary [0, {self.tok.vocab_size})")
        self.ids.append(token_id)
        k = len(self.ids)
        while k > self.read and self.tok.held_back(self.ids[k - 1]):
            k -= 1
        if k == self.read:
            return ""
        return self._release(k, final=False)

    def _release(self, k: int, final: bool) -> str:
        before, text = self._window(self.read), self._window(k)
        if not text.startswith(before) or (not final and text.endswith(REPLACEMENT)):
            return ""
        out = text[len(before):]
        if out and self.tok._decode(self.ids[self.read:k]):  # the next window starts at a point with text before it
            self.start = self.read
        self.read = k
        return out

    def flush(self) -> str:
        if len(self.ids) == self.read:
            return ""
        return self._release(len(self.ids), final=True)


def _spec_int(spec: dict[str, Any], key: str) -> int | None:
    value = spec.get(key)
    if value is not None:
        check_int(f"tokenizer {key!r}", value, low=0, error=ManifestError)
    return value


def make_tokenizer(spec: dict[str, Any], export_dir: str | os.PathLike | None = None, vocab_size: int | None = None) -> Tokenizer:
    """The tokenizer a manifest's ``tokenizer`` entry names (``export_dir``: where a huggingface tokenizer's
    files are; ``vocab_size``: the model's, which its ids must fit). A kind without text raises ManifestError
    saying what to pass instead."""
    kind = spec.get("kind")
    eos = _spec_int(spec, "eos_id")
    eos_ids = spec.get("eos_ids")
    if eos_ids is not None:
        eos_ids = [check_int("tokenizer 'eos_ids'", i, low=0, error=ManifestError) for i in eos_ids]
    if kind == "bytes":
        offset = check_int("tokenizer 'offset'", spec.get("offset", 0), low=0, error=ManifestError)
        return ByteTokenizer(eos_id=eos, offset=offset, eos_ids=eos_ids)
    if kind == HUGGINGFACE:
        if export_dir is None:
            raise ManifestError("a 'huggingface' tokenizer is read from the export folder; pass export_dir")
        files = spec.get("files") or {}
        if TOKENIZER_FILE not in files:
            raise ManifestError(f"the manifest's tokenizer names no {TOKENIZER_FILE}; re-export the model")
        path = Path(export_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ManifestError(f"{export_dir} lacks {TOKENIZER_FILE}, the tokenizer named in edgelin.json; copy the whole export folder, or re-export the model")
        if file_sha256(path) != files[TOKENIZER_FILE]:
            raise ManifestError(f"{path} is not the file edgelin.json describes (its sha256 differs); re-export the model")
        tok = read_hf_tokenizer(path)
        top, token = tokenizer_id_range(tok)
        vocab = vocab_size if vocab_size is not None else top + 1
        if top >= vocab:
            raise ManifestError(f"{path}: token {token!r} has id {top}, outside the model's vocabulary [0, {vocab}); re-export the model")
        return HuggingFaceTokenizer(
            tok, vocab_size=vocab, bos_id=_spec_int(spec, "bos_id"), eos_id=eos, eos_ids=eos_ids, pad_id=_spec_int(spec, "pad_id"),
            add_bos=bool(spec.get("add_bos", False)), skip_special_tokens=bool(spec.get("skip_special_tokens", True)),
        )
    if kind == "ids":
        raise ManifestError(
            "this export has no text tokenizer (tokenizer kind 'ids'); pass token ids instead of text (edgelin generate "
            "--prompt-ids 1,2,3; Generator(session, [[1, 2, 3]])), or re-export with `edgelin export --tokenizer PATH` "
            "(a folder with tokenizer.json)"
        )
    raise ManifestError(
        f"this export uses tokenizer kind {kind!r}, which edgelin.runtime does not know (known: {', '.join(TOKENIZERS)}); "
        "pass token ids instead of text (edgelin generate --prompt-ids 1,2,3), or upgrade edgelin"
    )


TOKENIZERS = {"bytes": ByteTokenizer, HUGGINGFACE: HuggingFaceTokenizer}


__all__ = [
    "HF_FILES", "HUGGINGFACE", "TOKENIZER_FILE", "ByteTokenizer", "ByteStreamDecoder", "HuggingFaceStreamDecoder",
    "HuggingFaceTokenizer", "TOKENIZERS", "Tokenizer", "import_tokenizers", "make_tokenizer", "read_hf_tokenizer",
    "tokenizer_id_range",
]
