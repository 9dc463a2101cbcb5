"""Sharded checkpoints: a ``model.safetensors.index.json`` and its shards (transformers' save_pretrained writes
them above its shard size) import exactly as the one-file checkpoint, with every malformed index refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import WEIGHTS_FILE, WEIGHTS_INDEX, load_checkpoint, weights_sha256


@pytest.fixture(scope="module")
def single(fla_oracle, tmp_path_factory):
    return fla_oracle.build(tmp_path_factory.mktemp("single") / "ckpt", model_type="gla", use_short_conv=True)


def shard(single, out, *, names=None, twice: str | None = None):
    """``single`` split into two shards with an index (``names``: the shard file names; ``twice``: a tensor also
    put in the second shard)."""
    out.mkdir()
    (out / "config.json").write_text((single / "config.json").read_text())
    tensors = load_file(single / WEIGHTS_FILE)
    names = names or ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: tuple[dict, dict] = ({}, {})
    weight_map = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        parts[i % 2][name] = t
        weight_map[name] = names[i % 2]
    if twice is not None:
        parts[1][twice] = tensors[twice]
    for part, name in zip(parts, names):
        if "/" not in name:
            save_file(part, out / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return out


def test_a_sharded_checkpoint_imports_as_the_one_file_checkpoint(single, tmp_path):
    sharded = shard(single, tmp_path / "sharded")
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, ref_state = load_checkpoint(single)(ids)
        got, state = load_checkpoint(sharded)(ids)
    assert torch.equal(got, ref) and all(torch.equal(state[k], v) for k, v in ref_state.items())
    digest = weights_sha256(sharded)
    assert digest == weights_sha256(sharded) and digest != weights_sha256(single)  # the index and the shards


@pytest.mark.parametrize("how, fragments", [
    ("missing", ("model-00002-of-00002.safetensors", "is not in")),
    ("outside", ("'../outside.safetensors'", "in the checkpoint folder itself")),
    ("twice", ("is in both",)),
    ("not-json", ("not a readable index",)),
])
def test_a_malformed_index_is_refused_by_name(single, tmp_path, refused, how, fragments):
    if how == "outside":
        sharded = shard(single, tmp_path / "ckpt", names=("model-00001-of-00002.safetensors", "../outside.safetensors"))
    else:
        sharded = shard(single, tmp_path / "ckpt", twice="model.norm.weight" if how == "twice" else None)
    if how == "missing":
        (sharded / "model-00002-of-00002.safetensors").unlink()
    if how == "not-json":
        (sharded / WEIGHTS_INDEX).write_text("{not json")
    refused(sharded, *fragments)


@pytest.mark.parametrize("kind", ["fla-gla", "fla-gla-sharded", "edgelin"])
def test_a_checkpoint_folder_is_read_once_per_export(single, tmp_path, monkeypatch, kind):
    """An export reads the checkpoint's config.json once (open_checkpoint), then the Checkpoint value goes to the
    importer, the weights loader, the tokenizer's special-id lookup and the source hash: counted at the system's
    open calls up to the first graph's tracing, for an fla checkpoint (one file, sharded) with a tokenizer.json
    beside it, and for edgelin's own checkpoint."""
    import builtins
    import io
    import os
    import shutil
    from pathlib import Path

    import tokenizers

    from edgelin.errors import ExportError
    from edgelin.exporters import exporter, tracing
    from edgelin.models import bundled_checkpoint

    if kind == "edgelin":
        if bundled_checkpoint() is None:
            pytest.skip("this install has no bundled model")
        ckpt = tmp_path / "ckpt"
        shutil.copytree(bundled_checkpoint(), ckpt)
    elif kind == "fla-gla-sharded":
        ckpt = shard(single, tmp_path / "ckpt")
    else:
        ckpt = tmp_path / "ckpt"
        shutil.copytree(single, ckpt)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.save(str(ckpt / "tokenizer.json"))  # its special ids are looked up in config.json too
    opened: list[str] = []
    real_os_open, real_io_open = os.open, io.open

    def os_open(path, *args, **kwargs):
        opened.append(os.fspath(path) if not isinstance(path, int) else "")
        return real_os_open(path, *args, **kwargs)

    def io_open(file, *args, **kwargs):
        opened.append(os.fspath(file) if not isinstance(file, int) else "")
        return real_io_open(file, *args, **kwargs)

    class Traced(Exception):
        pass

    def stop(*args, **kwargs):
        raise Traced

    monkeypatch.setattr(tracing, "export_graph", stop)
    with monkeypatch.context() as m:
        m.setattr(os, "open", os_open)
        m.setattr(io, "open", io_open)
        m.setattr(builtins, "open", io_open)
        with pytest.raises(ExportError, match=r"export failed \(Traced\); nothing was written") as raised:
            exporter.export(ckpt, tmp_path / "out")
    assert isinstance(raised.value.__cause__, Traced)  # it got as far as tracing
    reads = [p for p in opened if Path(p).name == "config.json"]
    assert len(reads) == 1, reads


def test_weights_are_copied_into_the_model_one_tensor_at_a_time(single, tmp_path, monkeypatch):
    """Loading holds the model and the tensor being copied, not the whole checkpoint beside the model: when a
    tensor is read, every tensor read before it has been let go. The sharded
    copy imports the same way."""
    import weakref

    from edgelin.importers import weights

    live: list[weakref.ref] = []
    most = [0]
    real_get = weights._get

    def get(handle, name, file):  # tensors hold no reference cycles: a weakref dies when the last reference goes
        most[0] = max(most[0], sum(r() is not None for r in live))
        t = real_get(handle, name, file)
        live.append(weakref.ref(t))
        return t

    monkeypatch.setattr(weights, "_get", get)
    for folder in (single, shard(single, tmp_path / "sharded")):
        live.clear()
        model = load_checkpoint(folder)
        assert len(live) >= len(list(model.parameters())) > 2  # every tensor went through the reader
        assert most[0] == 0, f"{most[0]} earlier tensor(s) still held when one was read"
