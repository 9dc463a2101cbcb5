"""The bundled checkpoint (edgelin.models.bundled_checkpoint()) is the one its model card describes, and it
has learned something: held-out bits per byte well below the unigram baseline.

The card (models/stdlib-linear/README.md) states the sha256 of config.json and model.safetensors and the
held-out bits per byte on the first EVAL_BYTES bytes of the held-out standard-library modules (whole files
the model never saw, edgelin.models.corpus); this test parses them from the card.
"""

import hashlib
import re

import pytest
import torch

from edgelin.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, weights_sha256
from edgelin.model import LinearLM
from edgelin.models import BUNDLED, bundled_checkpoint
from edgelin.models import corpus
from edgelin.models.train import heldout_bits_per_byte, unigram_bits_per_byte

EVAL_BYTES = 8192  # the held-out slice the card reports and this test recomputes
# Measured (card): 1.22 bits/byte on this slice against a unigram baseline of 4.20, i.e. 3.0 bits below it.
# A linear model without a decay stays much closer to the unigram baseline (the card's kernel-choice table:
# 2.73 against 4.47 on held-out code, 1.7 bits below), so a 2-bit margin fails such a model and still leaves
# a bit of room for another Python's standard library and float differences.
MARGIN_BITS = 2.0


@pytest.fixture(scope="module")
def checkpoint():
    path = bundled_checkpoint()
    if path is None:
        pytest.fail(f"edgelin.models.bundled_checkpoint() found no {BUNDLED!r} checkpoint in this install")
    return path


@pytest.fixture(scope="module")
def card(checkpoint):
    return (checkpoint / "README.md").read_text(encoding="utf-8")


def _card_value(card: str, label: str) -> str:
    match = re.search(rf"^\|\s*{re.escape(label)}\s*\|\s*`?([^|`]+?)`?\s*\|", card, flags=re.MULTILINE)
    if match is None:
        pytest.fail(f"the model card has no table row {label!r}")
    return match.group(1).strip()


def test_files_match_the_card(checkpoint, card):
    assert weights_sha256(checkpoint) == _card_value(card, "sha256 of model.safetensors")
    config_sha = hashlib.sha256((checkpoint / CONFIG_FILE).read_bytes()).hexdigest()
    assert config_sha == _card_value(card, "sha256 of config.json")
    assert (checkpoint / WEIGHTS_FILE).stat().st_size < 20 * 1024 * 1024


def test_loads_as_a_linear_model(checkpoint, card):
    model = load_checkpoint(checkpoint)
    assert isinstance(model, LinearLM)
    assert model.cfg.vocab_size == 256
    assert model.cfg.feature_map == _card_value(card, "feature map")
    assert model.num_parameters() == int(_card_value(card, "parameters").replace(",", ""))


@pytest.fixture(scope="module")
def heldout_bpb(checkpoint, card):
    """(bits/byte of the bundled model, unigram bits/byte) on the first EVAL_BYTES held-out code bytes."""
    torch.manual_seed(0)
    model = load_checkpoint(checkpoint)
    heldout = corpus.heldout_text("code")
    train = corpus.join(corpus.select(heldout=False))
    seq_len = int(_card_value(card, "sequence length (train and eval)"))
    return heldout_bits_per_byte(model, heldout, seq_len, max_bytes=EVAL_BYTES), unigram_bits_per_byte(train, heldout[:EVAL_BYTES])


def test_heldout_bits_per_byte_beat_the_unigram_baseline(heldout_bpb):
    bpb, unigram = heldout_bpb
    assert bpb < unigram - MARGIN_BITS, f"held-out {bpb:.3f} bits/byte vs unigram {unigram:.3f}"


def test_card_numbers_reproduce(card, heldout_bpb):
    """The card's numbers for the same slice, recomputed; only on the corpus the card was measured on."""
    if corpus.file_list_sha256() != _card_value(card, "file list sha256"):
        pytest.skip("this Python's standard library differs from the one the card was measured on")
    bpb, unigram = heldout_bpb
    # loose: thread counts and platforms change float summation order
    assert bpb == pytest.approx(float(_card_value(card, f"held-out bits/byte, code, first {EVAL_BYTES:,} bytes")), abs=0.01)
    assert unigram == pytest.approx(float(_card_value(card, f"unigram baseline bits/byte, code, first {EVAL_BYTES:,} bytes")), abs=1e-4)


class _Uniform(torch.nn.Module):
    """Equal logits for every byte: exactly 8 bits per byte, whatever the windows."""

    def forward(self, ids, state=None):
        return torch.zeros(*ids.shape, 256), state


@pytest.mark.parametrize("n_bytes", [2, 255, 257, 1000], ids=["two", "below-window", "window", "windows+tail"])
def test_eval_helpers_on_known_answers(n_bytes):
    data = bytes(range(256)) * 4
    assert heldout_bits_per_byte(_Uniform(), data, seq_len=256, max_bytes=n_bytes) == pytest.approx(8.0, abs=1e-9)
    assert unigram_bits_per_byte(data, data[:n_bytes]) == pytest.approx(8.0, abs=1e-9)
