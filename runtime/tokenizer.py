"""Tokenizers the runtime knows, chosen by the manifest's ``tokenizer`` entry (``{"kind": "bytes"}``).

The byte tokenizer maps text to its UTF-8 bytes (ids 0..255). A streamed byte may end in the middle of
a multi-byte character, so decoding goes through an incremental decoder that holds the partial
character back until it is complete, and replaces invalid bytes with U+FFFD.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable, Protocol

import numpy as np

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.options import check_int

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

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

    def __init__(self, eos_id: int | None = None, offset: int = 0) -> None:
        self.eos_id = eos_id
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
        return "".join(dec.feed(i) for i in ids) + dec.flush()

    def decoder(self) -> "ByteStreamDecoder":
        return ByteStreamDecoder(self.offset)


class ByteStreamDecoder:
    """Feeds one byte id at a time; returns only complete characters. Ids that are no byte decode as U+FFFD."""

    def __init__(self, offset: int = 0) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = offset

    def feed(self, token_id: int) -> str:
        token_id = int(token_id) - self.offset
        if not 0 <= token_id < 256:
            return self._utf8.decode(b"", final=True) + REPLACEMENT  # end any partial char, then mark the bad id
        return self._utf8.decode(bytes((token_id,)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


TOKENIZERS = {"bytes": ByteTokenizer}


def make_tokenizer(spec: dict[str, Any]) -> Tokenizer:
    """The tokenizer a manifest's ``tokenizer`` entry names; an unknown kind raises ManifestError."""
    kind = spec.get("kind")
    if kind not in TOKENIZERS:
        raise ManifestError(
            f"this export uses tokenizer kind {kind!r}, which edgelin.runtime does not know "
            f"(known: {', '.join(TOKENIZERS)}); pass token ids instead of text"
        )
    eos = spec.get("eos_id")
    if eos is not None:
        check_int("tokenizer 'eos_id'", eos, low=0, error=ManifestError)
    offset = check_int("tokenizer 'offset'", spec.get("offset", 0), low=0, error=ManifestError)
    return TOKENIZERS[kind](eos_id=eos, offset=offset)


__all__ = ["ByteTokenizer", "ByteStreamDecoder", "TOKENIZERS", "Tokenizer", "make_tokenizer"]
