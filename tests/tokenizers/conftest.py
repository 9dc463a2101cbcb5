"""Hugging Face tokenizers trained here with the ``tokenizers`` package (small, well under a second each), and
one export of a tiny model for each.

``hf_tokenizer(kind)`` -> a folder with ``tokenizer.json`` (and the companion files of that kind):
- ``bytelevel``: GPT-2-style byte-level BPE; eos ``<|endoftext|>``; generation_config.json names two eos ids.
- ``sentencepiece``: Llama-style: Metaspace pre-tokenizer, BPE with byte fallback (``<0x00>``..``<0xFF>`` at ids
  3..258), a post-processor that prepends ``<s>``; tokenizer_config.json names the special tokens.
- ``ascii``: a BPE over ASCII text with an unknown token, split on whitespace and punctuation, no decoder
  (``tokenizers`` then joins the tokens with spaces).

``hf_export(kind)`` -> an export folder of a tiny LinearLM (vocab 512) exported with that tokenizer.
"""

from __future__ import annotations

import json

import pytest

VOCAB = 512  # the tiny model's vocabulary: every tokenizer here fits in it
CORPUS = [
    "Hello world, this is a test of the tokenizer. The quick brown fox jumps over the lazy dog.",
    "def stack(items):\n    return [x for x in items if x]\n\nclass Stack:\n    pass\n",
    "Emoji 😀🦀👍🏽 and CJK 漢字かな한국어 and combining e\u0301 a\u0308 n\u0303 café naïve.",
    "Numbers 0123456789, symbols !@#$%^&*()[]{}<>/\\|~`'\" and tabs\tand newlines\n",
] * 20
KINDS = ("bytelevel", "sentencepiece", "ascii")


def _bytelevel(tk):
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|end|>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece(tk):
    meta = dict(replacement="\u2581", prepend_scheme="first", split=False)
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace(**meta)
    trainer = tk.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    # SentencePiece's layout: the specials, then the 256 byte pieces, then the learned pieces
    data = json.loads(tok.to_str())
    learned = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    vocab = {t: i for i, (t, _) in enumerate(learned[:3])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in learned[3:]:
        vocab.setdefault(t, len(vocab))
    data["model"]["vocab"] = vocab
    for added in data["added_tokens"]:
        added["id"] = vocab[added["content"]]
    data["decoder"] = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Metaspace", **meta}]}
    tok = tk.Tokenizer.from_str(json.dumps(data))
    tok.post_processor = tk.processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def _ascii(tk):
    tok = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[EOS]"], initial_alphabet=[chr(c) for c in range(32, 127)],
    )
    tok.train_from_iterator([t.encode("ascii", "ignore").decode() for t in CORPUS], trainer)
    return tok


BUILD = {"bytelevel": _bytelevel, "sentencepiece": _sentencepiece, "ascii": _ascii}


def write_companions(kind: str, folder) -> None:
    if kind == "bytelevel":
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1], "bos_token_id": 0}))
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "model_max_length": 1024}))
    elif kind == "sentencepiece":
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>",
        }))
        (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[EOS]", "add_bos_token": False}))


@pytest.fixture(scope="session")
def hf_tokenizer(export_cache):
    """kind -> a folder with that tokenizer's tokenizer.json and companion files (trained once per run, shared
    by the xdist workers: read it, don't change it)."""
    tk = pytest.importorskip("tokenizers")

    def build(kind, folder):
        folder.mkdir()
        tok = BUILD[kind](tk)
        assert tok.get_vocab_size(with_added_tokens=True) <= VOCAB
        tok.save(str(folder / "tokenizer.json"))
        write_companions(kind, folder)

    return lambda kind: export_cache.get(f"tok-{kind}", kind, lambda folder: build(kind, folder))


def tiny_lm(vocab_size: int = VOCAB, seed: int = 0):
    """A 2-layer LinearLM (d_model 32) with sharpened weights, so greedy streams vary."""
    import torch

    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16,
                      feature_map="elu+1", normalisation="denominator", conv_size=4)
    model = LinearLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(15.0)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(export_cache):
    """vocab size -> a checkpoint folder (config.json + model.safetensors) of the tiny model, no tokenizer (shared)."""
    from edgelin.checkpoint import save_checkpoint

    return lambda vocab: export_cache.get(f"ckpt-{vocab}", vocab, lambda folder: save_checkpoint(tiny_lm(vocab), folder))


@pytest.fixture(scope="session")
def hf_checkpoint(export_cache, hf_tokenizer):
    """A checkpoint folder of a tiny LinearLM (vocab 512) with the byte-level BPE tokenizer's files inside (shared)."""
    import shutil

    from edgelin.checkpoint import save_checkpoint

    def build(folder):
        save_checkpoint(tiny_lm(), folder)
        for f in hf_tokenizer("bytelevel").iterdir():
            shutil.copyfile(f, folder / f.name)

    return export_cache.get("ckpt-bytelevel", "tiny_lm with the bytelevel tokenizer", build)


@pytest.fixture(scope="session")
def hf_export(export_of, hf_checkpoint, hf_tokenizer, tiny_checkpoint):
    """kind -> an export folder of the tiny model with that tokenizer, each exported once per run (shared).

    ``bytelevel`` is the export of ``hf_checkpoint`` (the tokenizer picked up from the checkpoint folder, as a
    user's would be); the other kinds export the same weights with ``tokenizer=`` (``--tokenizer PATH``)."""

    def get(kind: str):
        if kind == "bytelevel":
            return export_of(hf_checkpoint, {"hf": kind}, label=f"hf-{kind}", check=False)
        return export_of(tiny_checkpoint(VOCAB), {"hf": kind}, label=f"hf-{kind}", check=False, tokenizer=hf_tokenizer(kind))

    return get


@pytest.fixture
def chat_export(hf_export, tmp_path):
    """A copy of the byte-level tokenizer's export whose tokenizer_config.json carries the ChatML template (the
    manifest's sha256 of it updated: the graphs are the export's own)."""
    from edgelin.runtime.manifest import Manifest
    from testkit.chat import CHATML, with_template

    out = with_template(hf_export("bytelevel"), tmp_path / "export", CHATML)
    Manifest.load(out)
    return out
