"""The trace cache (edgelin.exporters.traces): a graph traced once is taken from it by a later export of the same
model, byte for byte what a trace gives; anything a trace could depend on changes its key; a broken entry is
traced again and replaced; nothing in the folder that edgelin did not write is touched."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import tiny_model
from edgelin.exporters import export, graph_spec
from edgelin.exporters import tracing as export_impl
from edgelin.exporters import traces


def _keys(model, *, ragged: bool = False, opset: int = 18, ops: str = "portable", max_sequence: int = 4096,
          logits_at: bool = True) -> dict[str, str]:
    part = traces.model_key(model)
    keys = {}
    for graph in ("prefill", "decode"):
        spec = graph_spec(model, graph, lengths=ragged, logits_at=logits_at)
        keys[graph] = traces.trace_key(part, graph=graph, names=(spec.input_names, spec.output_names), example=spec.example,
                                       dynamic=spec.dynamic_shapes, opset=opset, ops=ops, max_sequence=max_sequence)
    return keys


def test_the_key_is_the_same_for_the_same_model_and_changes_with_anything_a_trace_sees():
    base = _keys(tiny_model("elu+1"))
    assert base == _keys(tiny_model("elu+1"))  # another object built the same way
    assert base["prefill"] != base["decode"]

    nudged = tiny_model("elu+1")
    with torch.no_grad():
        w = next(nudged.parameters())
        w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(float("inf")))  # one ulp
    changed = {
        "one weight one ulp up": _keys(nudged),
        "another seed": _keys(tiny_model("elu+1", seed=1)),
        "another feature map": _keys(tiny_model("relu")),
        "another chunk size": _keys(tiny_model("elu+1").with_chunk_size(8)),
        "ragged": _keys(tiny_model("elu+1"), ragged=True),
        "opset": _keys(tiny_model("elu+1"), opset=19),
        "fused lowering": _keys(tiny_model("elu+1"), ops="fused"),
        "max_sequence": _keys(tiny_model("elu+1"), max_sequence=8192),
        "every position's logits": _keys(tiny_model("elu+1"), logits_at=False),
    }
    buffered = tiny_model("elu+1")
    buffered.register_buffer("extra", torch.zeros(3))
    changed["a buffer"] = _keys(buffered)
    tensor_attr = tiny_model("elu+1")
    tensor_attr.table = torch.tensor([1.0, 2.0])  # a plain tensor attribute: a constant in the trace
    other_attr = tiny_model("elu+1")
    other_attr.table = torch.tensor([1.0, 2.5])
    changed["a tensor attribute"], changed["its value"] = _keys(tensor_attr), _keys(other_attr)
    for value in (1.0, 2.0):  # a numpy constant the forward might read
        arr = tiny_model("elu+1")
        arr.blocks[0].offsets = np.array([0.5, value], dtype=np.float32)
        changed[f"a numpy attribute holding {value}"] = _keys(arr)
    flagged = tiny_model("elu+1")
    flagged.blocks[0].some_flag = True
    changed["a plain attribute of a submodule"] = _keys(flagged)
    for scale in (2.0, 3.0):  # a function attribute: its code and what its closure holds
        fn = tiny_model("elu+1")
        fn.phi = lambda x, s=scale: x * s
        changed[f"a function attribute, default {scale}"] = _keys(fn)
    for name, keys in changed.items():
        assert keys["prefill"] != base["prefill"], name
        prefill_only = name in ("ragged", "every position's logits")  # the prefill graph's inputs only
        assert (keys["decode"] == base["decode"]) == prefill_only, name
    distinct = {k["prefill"] for k in changed.values()}
    assert len(distinct) == len(changed), "two different changes gave one key"


def test_the_code_digest_covers_edgelins_sources_and_the_models_own_files(tmp_path):
    files = traces._source_files(tiny_model("elu+1"))
    names = {p.name for p in files}
    assert {"model.py", "exporter.py", "traces.py", "session.py"} <= names  # the model, the exporter, the runtime

    class Mine(torch.nn.Module):  # a user's model class: this file
        pass

    mine = tiny_model("elu+1")
    mine.extra = Mine()
    assert any(p.name == "test_trace_cache.py" for p in traces._source_files(mine))


def test_a_stored_entry_is_checked_and_a_broken_one_replaced(tmp_path):
    cache = traces.TraceCache(tmp_path / "cache")
    src = tmp_path / "src"
    src.mkdir()
    (src / "g.onnx").write_bytes(b"graph")
    (src / "g.onnx.data").write_bytes(b"weights")
    assert cache.store("k", src, ["g.onnx", "g.onnx.data"], bound_used=True)
    assert not cache.store("k", src, ["g.onnx"], bound_used=False)  # a good entry is kept
    dest = tmp_path / "dest"
    dest.mkdir()
    hit = cache.lookup("k", dest)
    assert hit is not None and hit.bound_used and (dest / "g.onnx.data").read_bytes() == b"weights"
    assert cache.lookup("other", dest) is None

    (cache.entry("k") / "g.onnx.data").write_bytes(b"weightz")  # changed after it was stored
    assert cache.lookup("k", dest) is None
    assert cache.store("k", src, ["g.onnx", "g.onnx.data"], bound_used=False)  # replaced
    assert cache.lookup("k", dest) is not None and (cache.entry("k") / "g.onnx.data").read_bytes() == b"weights"

    (cache.root / "mine").mkdir()
    (cache.root / "mine" / "notes.txt").write_text("a user's")
    with pytest.raises(FileExistsError, match="is not a trace cache entry"):
        cache.store("mine", src, ["g.onnx"], bound_used=False)
    assert (cache.root / "mine" / "notes.txt").read_text() == "a user's"
    assert sorted(p.name for p in cache.root.iterdir() if not p.name.endswith(".lock")) == ["k", "mine"]  # no staging left


def test_an_export_takes_its_graphs_from_the_cache_and_traces_a_broken_one_again(exported, trace_cache, tmp_path, monkeypatch):
    """The shared export of the tiny elu+1 model was made through the run's trace cache: an export of the same model
    from a copy of its two entries traces nothing and writes the same bytes. Then one entry broken and the other
    replaced by a folder of the user's: the first graph is traced again and its entry replaced, the second traced and
    not kept (said), the user's folder untouched, and the export the same again."""
    model, shared = exported("elu+1")
    keys = _keys(model)
    cache = tmp_path / "cache"
    for key in keys.values():
        shutil.copytree(trace_cache / key, cache / key)
    traced = []
    real = export_impl.export_graph

    def counting(module, example, names, *args, **kwargs):
        traced.append(args[-1].name if args else "?")
        return real(module, example, names, *args, **kwargs)

    monkeypatch.setattr(export_impl, "export_graph", counting)
    said = []
    export(model, tmp_path / "a", check=False, trace_cache=cache, progress=said.append)
    assert traced == [] and sum("taken from the trace cache" in s for s in said) == 2
    names = sorted(p.name for p in shared.iterdir())
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (shared / name).read_bytes(), name

    entry = cache / keys["prefill"]
    record = json.loads((entry / traces.ENTRY_FILE).read_text())
    onnx_file = entry / next(n for n in record["files"] if n.endswith(".onnx"))
    onnx_file.write_bytes(onnx_file.read_bytes() + b"\0")
    shutil.rmtree(cache / keys["decode"])
    (cache / keys["decode"]).mkdir()
    (cache / keys["decode"] / "notes.txt").write_text("a user's")
    said.clear()
    export(model, tmp_path / "b", check=False, trace_cache=cache, progress=said.append)
    assert len(traced) == 2 and any("decode graph's trace was not kept" in s and "not a trace cache entry" in s for s in said), said
    assert traces.TraceCache(cache).lookup(keys["prefill"], tmp_path) is not None  # replaced, whole again
    assert (cache / keys["decode"] / "notes.txt").read_text() == "a user's"
    for name in names:
        assert (tmp_path / "b" / name).read_bytes() == (shared / name).read_bytes(), name


def test_a_delta_rule_export_from_the_cache_keeps_its_sequence_bound(exported, trace_cache, tmp_path, monkeypatch):
    """The delta rule's portable scan depends on ``max_sequence``, which the manifest records: an export whose
    graphs come from the cache records it as the traced one did (the same files, byte for byte), tracing nothing."""
    model, shared = exported("relu", normalisation="none", update="delta")
    assert json.loads((shared / "edgelin.json").read_text())["max_sequence"] == 4096
    cache = tmp_path / "cache"
    for key in _keys(model).values():
        shutil.copytree(trace_cache / key, cache / key)

    def no_trace(*args, **kwargs):
        raise AssertionError("traced although the cache holds both graphs")

    monkeypatch.setattr(export_impl, "export_graph", no_trace)
    export(model, tmp_path / "a", check=False, trace_cache=cache)
    for p in shared.iterdir():
        assert (tmp_path / "a" / p.name).read_bytes() == p.read_bytes(), p.name
