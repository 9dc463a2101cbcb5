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
    stored = sum(n for _, n in spans)
    both = sum(n for r in refs.values() for _, n in r.values())
    # each tensor is stored once: no two spans of the file hold the same bytes, and the file holds little more than one
    # graph's weights (what one graph alone holds, e.g. a prefill-only constant, is stored for it alone)
    assert len({data[off:off + n] for off, n in spans}) == len(spans), "the same bytes stored twice"
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


def _graph_with(tensors: dict[str, np.ndarray], output: str) -> onnx.ModelProto:
    """A graph whose output sums the named initializers (flattened and reduced), so that ONNX checks them all."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceSum", [name], [f"{name}_sum"], keepdims=0) for name in tensors]
    nodes.append(helper.make_node("Sum", [f"{name}_sum" for name in tensors], [output]))
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, [])],
                              initializer=[numpy_helper.from_array(a, name) for name, a in tensors.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_store_once_streams_each_tensor_in_pieces_and_keeps_one_copy(tmp_path, monkeypatch):
    """store_once on two hand-made graphs whose weights are in their own data files, read a few bytes at a time:
    a tensor both graphs hold (larger than a page) is written once, page-aligned; a tensor repeated inside one
    graph too; small tensors go back inside the graph; the per-graph files are removed; every graph reads back
    its exact arrays from the one file; memory holds a piece, not a tensor (the reads are counted)."""
    from onnx import numpy_helper

    from edgelin.exporters import weights

    rng = np.random.default_rng(0)
    shared = rng.standard_normal(PAGE // 4 + 3).astype(np.float32)  # past a page, not a multiple of the piece
    twice = rng.standard_normal(300).astype(np.float32)  # 1,200 bytes: above MIN_BYTES, below a page
    small = rng.standard_normal(5).astype(np.float32)
    graphs = {"prefill": {"shared": shared, "p_only": rng.standard_normal(400).astype(np.float32), "twice_a": twice,
                          "twice_b": twice.copy(), "small": small},
              "decode": {"shared_again": shared.copy(), "d_only": rng.standard_normal(700).astype(np.float32), "small_d": small}}
    files = {g: f"{g}.onnx" for g in graphs}
    for g, tensors in graphs.items():
        onnx.save(_graph_with(tensors, "y"), str(tmp_path / files[g]), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=f"{g}.onnx.data", size_threshold=0)  # every tensor outside, the small ones too
    reads = []
    real_read = weights._read_range

    def counted(path, offset, length):
        for piece in real_read(path, offset, length):
            reads.append(len(piece))
            yield piece

    monkeypatch.setattr(weights, "STREAM", 1000)
    monkeypatch.setattr(weights, "_read_range", counted)
    entry = weights.store_once(tmp_path, files)
    assert max(reads) == 1000 and sum(reads) > 2 * shared.nbytes  # in pieces; the shared tensor was read twice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.onnx", "prefill.onnx", WEIGHTS_FILE]
    assert entry == {"file": WEIGHTS_FILE, "bytes": (tmp_path / WEIGHTS_FILE).stat().st_size}
    refs = {g: _refs(tmp_path / f)[0] for g, f in files.items()}
    assert refs["prefill"]["shared"] == refs["decode"]["shared_again"] and refs["prefill"]["shared"][0] % PAGE == 0
    assert refs["prefill"]["twice_a"] == refs["prefill"]["twice_b"]
    assert "small" not in refs["prefill"] and "small_d" not in refs["decode"]
    distinct = shared.nbytes + twice.nbytes + 400 * 4 + 700 * 4
    assert distinct <= entry["bytes"] < distinct + PAGE, "each distinct tensor once (plus alignment)"
    for g, f in files.items():
        proto = onnx.load(str(tmp_path / f))
        onnx.checker.check_model(proto)
        got = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
        assert got.keys() == graphs[g].keys()
        for name, a in graphs[g].items():
            np.testing.assert_array_equal(got[name], a)


def _tied_graph(dtype=np.float32, rank=3) -> tuple[onnx.ModelProto, np.ndarray]:
    """ids -> Gather(E) -> x; logits = x @ Transpose(E): a tied head as torch.onnx writes it."""
    from onnx import TensorProto, helper, numpy_helper

    V, D = 37, 8
    E = np.random.default_rng(1).standard_normal((V, D)).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    lead = ["B", "T"][: rank - 1]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"], axis=0),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Et"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, lead)],
                              [helper.make_tensor_value_info("logits", elem, [*lead, V])], initializer=[numpy_helper.from_array(E, "E")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), E


@pytest.mark.parametrize("rank", [2, 3])
def test_a_tied_head_reads_the_table_in_place(rank):
    """MatMul(x, Transpose(E)) -> Gemm(x as [N, D], E, transB=1) shaped back: no transposed copy of the table for
    ONNX Runtime to fold into each session, and the same logits (float64 reference) for any leading shape."""
    import onnxruntime as ort

    from edgelin.exporters.weights import tied_head_in_place

    proto, E = _tied_graph(rank=rank)
    assert tied_head_in_place(proto) == 1
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "Transpose" not in ops and "MatMul" not in ops and ops.count("Gemm") == 1
    gemm = next(n for n in proto.graph.node if n.op_type == "Gemm")
    assert gemm.input[1] == "E" and [a.i for a in gemm.attribute if a.name == "transB"] == [1]
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    shape = (3, 5)[: rank - 1]
    ids = np.random.default_rng(2).integers(0, E.shape[0], shape)
    got = sess.run(None, {"ids": ids})[0]
    ref = E.astype(np.float64)[ids] @ E.astype(np.float64).T
    assert got.shape == (*shape, E.shape[0])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_an_fp16_tied_head_is_left_as_it_is():
    """fp16 Gemm is not in every ONNX Runtime's CPU kernels: fp16 heads keep their MatMul."""
    from edgelin.exporters.weights import tied_head_in_place

    proto, _ = _tied_graph(np.float16)
    before = proto.SerializeToString()
    assert tied_head_in_place(proto) == 0 and proto.SerializeToString() == before


def test_an_fp32_export_of_a_tied_model_has_no_transposed_table(exported):
    """The exporter applies it: a tied model's graphs read the embedding in place. (The vocabulary of 1,024 keeps
    torch.onnx's optimiser from folding the transpose into a second table at export, as it does for tables of a
    few thousand values: the tiny 256-id models hold a small transposed copy.)"""
    overrides, options = EXPORTS["fp32"]
    _, out = exported("elu+1", options=options, **overrides)
    for f in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(out / f), load_external_data=False)
        inits = {t.name for t in proto.graph.initializer}
        tables = {n.input[0] for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits}
        assert not [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in tables], f
        assert [n for n in proto.graph.node if n.op_type == "Gemm" and n.input[1] in tables], f"{f}: the head reads no table"
