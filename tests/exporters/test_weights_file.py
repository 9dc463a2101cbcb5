"""Weights stored once: both graphs reference one external-data file, each distinct tensor in it once."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest

from edgelin.errors import ManifestError
from edgelin.exporters.weights import MIN_BYTES, PAGE, WEIGHTS_FILE, initializers
from edgelin.runtime import load
from edgelin.runtime.manifest import Manifest, file_sha256


def _refs(path):
    """name -> (offset, length) of every external initializer of a graph; and the inline bytes it keeps."""
    proto = onnx.load(str(path), load_external_data=False)
    refs, inline = {}, 0
    for t in initializers(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            e = {x.key: x.value for x in t.external_data}
            assert e["location"] == WEIGHTS_FILE, (t.name, e)
            refs[t.name] = (int(e["offset"]), int(e["length"]))
        else:
            assert len(t.raw_data) < MIN_BYTES, f"{path.name}: {t.name} ({len(t.raw_data)} bytes) stayed inside the graph"
            inline += len(t.raw_data)
    return refs, inline


# fp32: a model with an embedding of 128 KiB (page-aligned); int4: the precision tests' export, shared with them
EXPORTS = {"fp32": ({"vocab_size": 1024}, {"precision": "fp32"}),
           "int4": ({}, {"precision": "int4", "state_dtype": "float32", "check": True})}


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_each_tensor_is_stored_once_and_both_graphs_point_at_it(exported, precision):
    overrides, options = EXPORTS[precision]
    _, out = exported("elu+1", options=options, **overrides)
    m = Manifest.load(out)
    assert m.weights == {"file": WEIGHTS_FILE, "bytes": (out / WEIGHTS_FILE).stat().st_size}
    assert m.sha256["weights"] == file_sha256(out / WEIGHTS_FILE)
    refs = {g: _refs(out / f)[0] for g, f in m.graphs.items()}
    spans = sorted(set(refs["prefill"].values()) | set(refs["decode"].values()))
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b, "two stored tensors overlap"
    assert spans[-1][0] + spans[-1][1] == m.weights["bytes"], "the file ends with its last tensor"
    assert precision != "fp32" or any(n >= PAGE for _, n in spans)
    for off, n in spans:
        if n >= PAGE:
            assert off % PAGE == 0, f"a {n}-byte tensor at offset {off}, not {PAGE}-aligned"
    # a graph's bytes are exactly the stored tensors it names
    data = (out / WEIGHTS_FILE).read_bytes()
    for g, f in m.graphs.items():
        proto = onnx.load(str(out / f))  # onnx reads the external data itself
        for t in initializers(proto.graph):
            if t.name in refs[g]:
                off, n = refs[g][t.name]
                assert t.raw_data == data[off:off + n], (g, t.name)
    shared = set(refs["prefill"].values()) & set(refs["decode"].values())
    stored = sum(n for _, n in spans)
    both = sum(n for r in refs.values() for _, n in r.values())
    # the graphs share almost all of their weights: stored once, the file holds little more than one graph's
    assert sum(n for _, n in shared) > 0.95 * stored, (shared, stored)
    assert stored < 0.55 * both, f"stored {stored:,} bytes for {both:,} referenced by the two graphs"
    assert m.weights["bytes"] < 1.1 * stored, "alignment padding above 10 %"


def test_graph_files_hold_no_weights(exported):
    _, out = exported("elu+1")
    for f in ("prefill.onnx", "decode.onnx"):
        assert (out / f).stat().st_size < 200_000, f"{f}: {(out / f).stat().st_size:,} bytes"
        refs, inline = _refs(out / f)
        assert inline < 0.01 * sum(n for _, n in refs.values())


def test_a_truncated_weights_file_is_refused_even_without_the_hash_check(exported, tmp_path):
    _, src = exported("elu+1")
    out = shutil.copytree(src, tmp_path / "e")
    os.truncate(out / WEIGHTS_FILE, (out / WEIGHTS_FILE).stat().st_size - 1)
    for check in (True, False):
        with pytest.raises(ManifestError, match=f"{WEIGHTS_FILE} is [0-9,]+ bytes but edgelin.json says"):
            load(out, provider="cpu", check_hashes=check)
    (out / WEIGHTS_FILE).unlink()
    with pytest.raises(ManifestError, match=f"lacks {WEIGHTS_FILE}, the weights file"):
        load(out, provider="cpu", check_hashes=False)


def test_weights_of_another_export_are_refused_by_hash(exported, tmp_path):
    """Two models of one config: the weights files have the same size; only the hash tells them apart."""
    _, a = exported("elu+1")
    _, b = exported("elu+1", seed=7)
    assert (a / WEIGHTS_FILE).stat().st_size == (b / WEIGHTS_FILE).stat().st_size
    out = shutil.copytree(a, tmp_path / "e")
    shutil.copy(b / WEIGHTS_FILE, out / WEIGHTS_FILE)
    with pytest.raises(ManifestError, match="is not the weights file edgelin.json describes"):
        load(out, provider="cpu")


def test_the_manifest_names_the_weights_file_consistently(exported):
    _, out = exported("elu+1")
    d = json.loads((out / "edgelin.json").read_text())
    for bad, why in [({**d, "weights": {"file": "prefill.onnx", "bytes": 1}}, "weights.file"),
                     ({**d, "weights": {"file": "../w.data", "bytes": 1}}, "weights"),
                     ({**d, "sha256": {k: v for k, v in d["sha256"].items() if k != "weights"}}, "sha256.weights")]:
        with pytest.raises(ManifestError, match=why):
            Manifest.from_dict(bad)
    old = {k: v for k, v in d.items() if k != "weights"}  # an export from before the weights file: still read
    old["sha256"] = {k: v for k, v in d["sha256"].items() if k != "weights"}
    assert Manifest.from_dict(old).weights is None


def test_a_copy_of_the_folder_runs_like_the_original(exported, tmp_path):
    """The graphs find the weights beside them wherever the folder goes (the references are relative)."""
    _, src = exported("elu+1")
    out = shutil.copytree(src, tmp_path / "moved" / "e")
    ids = np.arange(20, dtype=np.int64)[None] % 256
    a, b = load(src, provider="cpu"), load(out, provider="cpu")
    np.testing.assert_array_equal(a.prefill(ids, a.new_state()), b.prefill(ids, b.new_state()))


def test_without_prepacking_the_sessions_compute_the_same(exported):
    _, out = exported("elu+1")
    ids = np.arange(40, dtype=np.int64)[None] % 256
    a, b = load(out, provider="cpu"), load(out, provider="cpu", prepack=False)
    sa, sb = a.new_state(), b.new_state()
    np.testing.assert_allclose(a.prefill(ids, sa), b.prefill(ids, sb), rtol=0, atol=1e-5)
    np.testing.assert_allclose(a.decode(np.array([[7]]), sa), b.decode(np.array([[7]]), sb), rtol=0, atol=1e-5)
