"""The byte tokenizer and its incremental decoder."""

import numpy as np
import pytest

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.tokenizer import ByteTokenizer, make_tokenizer


def feed_all(ids):
    dec = ByteTokenizer().decoder()
    return [dec.feed(i) for i in ids], dec.flush()


def test_encode_is_utf8_bytes_and_decode_round_trips():
    tok = ByteTokenizer()
    text = "héllo, wörld € 😀"
    ids = tok.encode(text)
    assert ids.dtype == np.int64
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@pytest.mark.parametrize("char", ["é", "€", "😀"], ids=["2-byte", "3-byte", "4-byte"])
def test_partial_character_is_held_back_until_complete(char):
    raw = char.encode("utf-8")
    pieces, rest = feed_all(raw)
    assert pieces == [""] * (len(raw) - 1) + [char]
    assert rest == ""


def test_stream_of_pieces_concatenates_to_the_text():
    text = "a€b😀c"
    pieces, rest = feed_all(text.encode("utf-8"))
    assert "".join(pieces) + rest == text
    assert pieces[0] == "a" and pieces[-1] == "c"


def test_invalid_bytes_are_replaced():
    pieces, rest = feed_all([0x41, 0xFF, 0x42])  # 0xFF never occurs in UTF-8
    assert "".join(pieces) + rest == "A\ufffdB"


def test_truncated_character_followed_by_ascii_is_replaced_then_ascii_kept():
    pieces, rest = feed_all([0xE2, 0x82, 0x41])  # first two bytes of "€", then "A"
    assert "".join(pieces) + rest == "\ufffdA"


def test_flush_replaces_an_incomplete_character_at_the_end():
    pieces, rest = feed_all([0x41, 0xF0, 0x9F])
    assert "".join(pieces) == "A"
    assert rest == "\ufffd"


def test_ids_outside_the_byte_range_decode_as_replacement():
    pieces, rest = feed_all([0x41, 300, 0x42])
    assert "".join(pieces) + rest == "A\ufffdB"


def test_encode_refuses_non_text():
    with pytest.raises(RuntimeInputError, match="must be text"):
        ByteTokenizer().encode(b"bytes")


def test_manifest_kind_selects_the_tokenizer():
    tok = make_tokenizer({"kind": "bytes"})
    assert isinstance(tok, ByteTokenizer) and tok.eos_id is None
    assert make_tokenizer({"kind": "bytes", "eos_id": 0}).eos_id == 0


@pytest.mark.parametrize("spec", [{"kind": "sentencepiece"}, {}], ids=["unknown", "none"])
def test_unknown_tokenizer_kind_is_a_clear_error(spec):
    with pytest.raises(ManifestError, match=r"tokenizer kind .* \(known: bytes, huggingface\); pass token ids instead of text \(edgelin generate --prompt-ids"):
        make_tokenizer(spec)


def test_an_ids_only_export_says_what_to_pass_instead_of_text():
    with pytest.raises(ManifestError, match=r"no text tokenizer .*--prompt-ids 1,2,3.*--tokenizer PATH"):
        make_tokenizer({"kind": "ids"})


def test_bad_eos_id_is_refused():
    with pytest.raises(ManifestError, match="eos_id"):
        make_tokenizer({"kind": "bytes", "eos_id": -1})
