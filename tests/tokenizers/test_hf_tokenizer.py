"""The runtime's Hugging Face tokenizer against the ``tokenizers`` package itself: ids equal its encoding, the
streamed text is exactly its decoding of the ids so far (never a U+FFFD the whole decoding does not hold), for
a byte-level BPE, a SentencePiece-style (Metaspace + byte fallback) and a plain ASCII tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.tokenizer import HuggingFaceTokenizer

KINDS = ("bytelevel", "sentencepiece", "ascii")  # the tokenizers of this folder's conftest
# every kind of character the tests stream: ASCII, emoji (4-byte, ZWJ and skin tone), CJK, combining marks
TEXTS = [
    "Hello world, the quick brown fox.",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
    "Emoji 😀 🦀👍🏽 👨‍👩‍👧 and more",
    "漢字かな交じり文と한국어",
    "e\u0301 a\u0308 n\u0303 o\u0302\u0323 café naïve",
    "  leading spaces and trailing  ",
    "mixed: 漢😀e\u0301x !? \t\n end",
]

REPLACEMENT = "\ufffd"


def reference(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def ours(folder, **kw):
    ref = reference(folder)
    kw.setdefault("vocab_size", ref.get_vocab_size(with_added_tokens=True))
    return HuggingFaceTokenizer.from_file(folder / "tokenizer.json", **kw)


def stream(tok, ids):
    """(the pieces each id released, then what flush released)."""
    dec = tok.decoder()
    pieces = [dec.feed(i) for i in ids]
    return pieces, dec.flush()


def check_stream(tok, ref, ids):
    pieces, rest = stream(tok, ids)
    full = ref.decode(list(ids), skip_special_tokens=True)
    assert "".join(pieces) + rest == full
    released = ""
    for n, piece in enumerate(pieces, 1):
        released += piece
        so_far = ref.decode(list(ids[:n]), skip_special_tokens=True)
        assert so_far.startswith(released) or not so_far, (n, released, so_far)  # never ahead of the decoding so far
        assert full.startswith(released)
        # a U+FFFD is released only where the whole decoding has one at that place
        assert released.count(REPLACEMENT) <= full[: len(released)].count(REPLACEMENT)
    return pieces


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS, ids=[f"text{i}" for i in range(len(TEXTS))])
def test_stream_of_an_encoded_text_is_the_tokenizers_decoding(kind, text, hf_tokenizer):
    folder = hf_tokenizer(kind)
    ref, tok = reference(folder), ours(folder)
    ids = tok.encode(text)
    assert ids.dtype == np.int64
    assert ids.tolist() == ref.encode(text, add_special_tokens=False).ids
    check_stream(tok, ref, ids.tolist())
    # byte-level BPE round-trips any text; SentencePiece too, but for a leading space (its decoder strips one);
    # the ASCII one maps the rest to its unknown token
    if kind == "bytelevel" or kind == "sentencepiece" and not text.startswith(" "):
        assert tok.decode(ids) == text


@pytest.mark.parametrize("kind", KINDS)
def test_stream_of_random_ids_is_the_tokenizers_decoding(kind, hf_tokenizer):
    """Random ids split characters anywhere, make invalid UTF-8, mix byte pieces, words and special tokens."""
    folder = hf_tokenizer(kind)
    ref, tok = reference(folder), ours(folder)
    rng = np.random.default_rng(0)
    vocab = ref.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        ids = rng.integers(0, vocab, rng.integers(1, 40)).tolist()
        check_stream(tok, ref, ids)


def test_a_split_character_is_held_back_not_replaced(hf_tokenizer):
    folder = hf_tokenizer("bytelevel")
    ref, tok = reference(folder), ours(folder)
    ids = ref.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    pieces = check_stream(tok, ref, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "😀"


def test_byte_fallback_pieces_are_held_back_until_their_group_ends(hf_tokenizer):
    folder = hf_tokenizer("sentencepiece")
    ref, tok = reference(folder), ours(folder)
    ids = ref.encode("a 🐍 b", add_special_tokens=False).ids
    crab = [i for i in ids if ref.id_to_token(i).startswith("<0x")]
    assert len(crab) == 4
    pieces = check_stream(tok, ref, ids)
    assert REPLACEMENT not in "".join(pieces)
    assert "🐍" in "".join(pieces)
    # a group that turns invalid decodes every byte as U+FFFD, also the bytes that were valid alone
    slash, e2 = ref.token_to_id("<0x2F>"), ref.token_to_id("<0xE2>")
    assert ref.decode([slash, e2]) == REPLACEMENT * 2
    assert stream(tok, [slash, e2]) == (["", ""], REPLACEMENT * 2)


def test_sentencepiece_leading_space_matches_whole_decoding(hf_tokenizer):
    folder = hf_tokenizer("sentencepiece")
    ref, tok = reference(folder), ours(folder)
    ids = ref.encode("one two  three", add_special_tokens=False).ids
    pieces = check_stream(tok, ref, ids)
    assert "".join(pieces) == "one two  three"


def test_add_bos_prepends_the_bos_as_the_post_processor_does(hf_tokenizer):
    folder = hf_tokenizer("sentencepiece")
    ref = reference(folder)
    tok = ours(folder, bos_id=1, add_bos=True)
    for text in TEXTS:
        assert tok.encode(text).tolist() == ref.encode(text).ids  # tokenizers' default: with the post-processor
    assert ours(folder, bos_id=1, add_bos=False).encode("hi").tolist() == ref.encode("hi", add_special_tokens=False).ids


def test_special_tokens_skipped_or_kept_as_asked(hf_tokenizer):
    folder = hf_tokenizer("bytelevel")
    ref = reference(folder)
    ids = ref.encode("hi", add_special_tokens=False).ids + [0]
    assert ours(folder).decode(ids) == "hi"
    assert ours(folder, skip_special_tokens=False).decode(ids) == "hi<|endoftext|>"
    pieces, rest = stream(ours(folder, skip_special_tokens=False), ids)
    assert "".join(pieces) + rest == "hi<|endoftext|>"


def test_lone_surrogate_and_non_text_are_refused(hf_tokenizer):
    tok = ours(hf_tokenizer("bytelevel"))
    with pytest.raises(RuntimeInputError, match="lone surrogate"):
        tok.encode("a\udc80b")
    with pytest.raises(RuntimeInputError, match="must be text"):
        tok.encode(b"bytes")


def test_add_bos_without_a_bos_id_is_refused(hf_tokenizer):
    with pytest.raises(ManifestError, match="add_bos"):
        ours(hf_tokenizer("sentencepiece"), add_bos=True)
