"""The bundled model's corpus (edgelin.models.corpus): the standard library's source and pydoc topics, split
by whole document, deterministic, deduplicated, with no held-out bytes in training."""

from __future__ import annotations

import hashlib

import pytest

from edgelin.models import corpus


@pytest.fixture(scope="module")
def docs():
    return corpus.documents()


def test_both_kinds_are_there_and_named(docs):
    kinds = {d.kind for d in docs}
    assert kinds == {"code", "topic"}
    code = [d for d in docs if d.kind == "code"]
    assert len(code) > 1000 and sum(len(d.text) for d in code) > 10_000_000  # tens of MB of source
    assert all(d.name.startswith("Lib/") and d.name.endswith(".py") for d in code)
    assert all(d.name.startswith("topics/") for d in docs if d.kind == "topic")
    assert [d.name for d in docs] == sorted(d.name for d in docs)


def test_excluded_folders_and_duplicates(docs):
    names = {d.name for d in docs}
    assert not any(n.split("/")[1] in corpus.EXCLUDED for n in names if n.startswith("Lib/"))
    assert "Lib/json/decoder.py" in names and "topics/for" in names
    digests = [hashlib.sha256(d.text).digest() for d in docs]
    assert len(set(digests)) == len(digests)  # exact duplicates dropped
    assert all(d.text for d in docs)


def test_split_is_by_whole_document_and_fixed_by_name(docs):
    held = [d for d in docs if d.heldout]
    train = [d for d in docs if not d.heldout]
    assert held and train and {d.name for d in held}.isdisjoint(d.name for d in train)
    for kind, every in corpus.HELDOUT_EVERY.items():
        share = sum(d.heldout for d in docs if d.kind == kind) / sum(d.kind == kind for d in docs)
        assert 0.5 / every < share < 2.0 / every, (kind, share)
    # a function of the name alone: the same answer for a document the corpus does not hold
    assert corpus.is_heldout("Lib/asyncio/taskgroups.py", "code") == any(
        d.name == "Lib/asyncio/taskgroups.py" and d.heldout for d in docs)
    assert corpus.select(heldout=True, kind="topic") == [d for d in held if d.kind == "topic"]


def test_no_heldout_text_is_in_training(docs):
    """Dedup by bytes means no held-out file is also in training under another name; spot-check long lines."""
    train = corpus.join(corpus.select(heldout=False))
    for d in corpus.select(heldout=True, kind="code")[:10]:
        assert d.text not in train, d.name


def test_join_and_file_list_hash(docs):
    two = list(docs[:2])
    assert corpus.join(two) == two[0].text + corpus.SEPARATOR + two[1].text + corpus.SEPARATOR
    assert corpus.file_list_sha256() == corpus.file_list_sha256(docs)
    changed = [corpus.Document(docs[0].name, docs[0].kind, docs[0].text + b"#")] + list(docs[1:])
    assert corpus.file_list_sha256(changed) != corpus.file_list_sha256(docs)
    assert corpus.heldout_text("code") == corpus.join(corpus.select(heldout=True, kind="code"))


def test_training_batches_draw_from_each_source_by_weight():
    import torch

    from edgelin.models.train import mixed_batch

    a = torch.zeros(1000, dtype=torch.long)  # source 0: all zeros
    b = torch.arange(1000) % 7 + 1  # source 1: never zero
    gen = torch.Generator().manual_seed(0)
    x, y = mixed_batch([(a, 1.0), (b, 0.0)], 8, 16, gen)
    assert x.shape == y.shape == (8, 16) and int(x.abs().sum()) == 0
    x, y = mixed_batch([(a, 0.0), (b, 1.0)], 8, 16, gen)
    assert bool((x > 0).all()) and bool((y[:, :-1] == x[:, 1:]).all())  # targets are the next bytes
    x, _ = mixed_batch([(a, 0.5), (b, 0.5)], 400, 4, torch.Generator().manual_seed(1))
    from_a = int((x.sum(-1) == 0).sum())
    assert 150 < from_a < 250  # about half the rows from each source


def test_directory_text_joins_python_files(tmp_path):
    from edgelin.models.train import directory_text

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "b.py").write_bytes(b"b = 2\n")
    (tmp_path / "a.py").write_bytes(b"a = 1\n")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    assert directory_text(tmp_path) == b"a = 1\n" + corpus.SEPARATOR + b"b = 2\n" + corpus.SEPARATOR
    with pytest.raises(FileNotFoundError, match="no \\*.py file"):
        directory_text(tmp_path / "pkg" / "missing")


def test_the_recipe_builds_a_delta_rule_model():
    """``--update delta`` (the kernel-choice table's Gated DeltaNet row) reaches the model's config."""
    from edgelin.models.train import build_model, parse_args

    model = build_model(parse_args(["--feature-map", "relu", "--normalisation", "none", "--decay", "scalar", "--update", "delta",
                                    "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--head-dim", "16"]))
    assert model.cfg.update == "delta" and model.cfg.decay == "scalar"
    assert build_model(parse_args(["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--head-dim", "16"])).cfg.update == "additive"


def test_the_recipe_builds_a_hybrid():
    """``--attn-layers 1`` (the kernel-choice table's hybrid row) puts softmax attention at layer 1 and linear elsewhere."""
    from edgelin.models.train import build_model, parse_args

    small = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--head-dim", "16"]
    model = build_model(parse_args(["--decay", "scalar", "--attn-layers", "1", *small]))
    assert model.cfg.attn_layers == (1,) and model.cfg.decay == "scalar"
    assert [spec.key for spec in model.state_specs() if "key" in spec.key or "value" in spec.key]  # a KV cache in the state
    assert build_model(parse_args(small)).cfg.attn_layers == ()
