"""The precision conversions that read a graph's weights one tensor at a time from its data file and write the new one
likewise (``precision.fp16_file``, ``int4_file``, ``int8_file``, ``weights.save_graph``) against the same conversion of
the graph loaded whole into memory (``precision.convert``; for int4 that is ONNX Runtime's own MatMulNBitsQuantizer, which
the file path reproduces one weight at a time): the same graph, every initializer's bytes equal. Traced
graphs of the tiny model, tied and untied (the head's two paths), from the run's trace cache."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from edgelin.exporters.precision import convert, fp16_file, int4_file, int8_file
from edgelin.exporters.precision import common
from edgelin.exporters.precision.int4 import weight_digest
from edgelin.exporters.tracing import trace_graphs
from edgelin.exporters import weights
from edgelin.exporters.weights import external_files, initializers, save_graph, tied_head_in_place
from edgelin.exporters.write import GRAPH_FILES
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def traced(tmp_path_factory, trace_cache):
    """tied -> a folder holding both fp32 graphs as traced (each with its ``.data`` file)."""
    out = {}
    for tied in (True, False):
        folder = tmp_path_factory.mktemp("tied" if tied else "untied")
        trace_graphs(tiny_model(tie_embeddings=tied), folder, ragged=False, logits_at=True, opset=18, ops="portable", max_sequence=4096,
                     trace_cache=trace_cache, say=lambda _m: None)
        out[tied] = folder
    return out


def _eight_bit_digest(path) -> frozenset[str]:
    """The digest of one MatMul weight of the graph: int4 stores it in 8-bit blocks (the path a Mamba-1 takes)."""
    proto = onnx.load(str(path))
    inits = {t.name: t for t in proto.graph.initializer}
    w = next(inits[n.input[1]] for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2)
    return frozenset({weight_digest(numpy_helper.to_array(w))})


CASES = {
    "fp16": (lambda p, e: fp16_file(p, "float32"), {"precision": "fp16"}),
    "fp16-state16": (lambda p, e: fp16_file(p, "float16"), {"precision": "fp16", "state_dtype": "float16"}),
    "int4": (lambda p, e: int4_file(p, "int8", e), {"precision": "int4"}),
    "int4-table4": (lambda p, e: int4_file(p, "int4", e), {"precision": "int4", "embedding": "int4"}),
    "int4-fp32-table": (lambda p, e: int4_file(p, "fp32", e), {"precision": "int4", "embedding": "fp32"}),
    "int8-block": (lambda p, e: int8_file(p, "int8", "block"), {"precision": "int8", "int8_scheme": "block"}),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_conversion_from_the_file_is_the_conversion_in_memory(traced, tmp_path, monkeypatch, case, tied):
    streamed, options = CASES[case]
    monkeypatch.setattr(weights, "STREAM", 4096)  # a tensor crosses several pieces, as a real model's do at 16 MB
    for fname in GRAPH_FILES.values():
        src = traced[tied] / fname
        eight = _eight_bit_digest(src) if case == "int4" else frozenset()
        whole, _ = convert(onnx.load(str(src)), **options, **({"eight_bit": eight} if eight else {}))
        tied_head_in_place(whole)

        work = tmp_path / fname.split(".")[0]
        work.mkdir()
        for f in (fname, fname + ".data"):
            shutil.copyfile(traced[tied] / f, work / f)
        proto, note = streamed(work / fname, eight)
        stored = {t.name for t in initializers(onnx.load(str(src), load_external_data=False).graph) if t.data_location == onnx.TensorProto.EXTERNAL}
        assert [t.name for t in initializers(proto.graph) if t.name in stored and t.HasField("raw_data")] == []  # not read into memory
        tied_head_in_place(proto)
        # int4's and int8's quantised weights, written as made to a spill file beside the graph: adopted as one of its
        # data files (the exporter's store moves them on and removes it), or removed where nothing large was spilled
        save_graph(proto, work / fname, note.recast, adopt=note.spilled)
        files = external_files(onnx.load(str(work / fname), load_external_data=False))
        spill = {note.spilled.name} & files if note.spilled is not None else set()
        assert note.spilled is None or note.spilled.parent == work
        assert files - spill <= {fname + ".data"}
        assert sorted(p.name for p in work.iterdir()) == sorted([fname, fname + ".data", *spill])  # nothing else left behind
        ours = onnx.load(str(work / fname))

        assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in whole.graph.node]
        assert [t.name for t in ours.graph.initializer] == [t.name for t in whole.graph.initializer]
        for a, b in zip(ours.graph.initializer, whole.graph.initializer):
            assert (a.data_type, list(a.dims)) == (b.data_type, list(b.dims)), a.name
            assert np.array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b), equal_nan=True), a.name
        assert [(o.domain, o.version) for o in ours.opset_import] == [(o.domain, o.version) for o in whole.opset_import]
        assert ours.graph.input == whole.graph.input and ours.graph.output == whole.graph.output


def test_fp16_recast_piece_by_piece_rounds_as_the_converter_rounds_a_whole_tensor():
    from onnxruntime.transformers.float16 import convert_np_to_float16

    from edgelin.exporters.precision.fp16 import _to_fp16

    rng = np.random.default_rng(0)
    edge = np.array([1e-9, -1e-9, 3e-8, -3e-8, 7e4, -7e4, 65504.0, 0.0, -0.0, np.nan, np.inf, -np.inf, 6e-5], np.float32)
    w = np.concatenate([rng.standard_normal(997).astype(np.float32), edge, rng.standard_normal(500).astype(np.float32) * 1e-7])
    raw, cuts = w.tobytes(), [0, 4, 400, 4000, 4052, len(w.tobytes())]
    ours = b"".join(_to_fp16(raw[a:b]) for a, b in zip(cuts, cuts[1:]))
    whole = convert_np_to_float16(w).tobytes()
    assert ours == whole
    assert ours != w.astype(np.float16).tobytes()  # the converter's clamping is what is reproduced, not a plain cast


@pytest.mark.parametrize("slab", [None, 600], ids=["whole", "slabs"])
def test_int4_one_weight_at_a_time_is_onnx_runtimes_quantiser_on_awkward_weights(tmp_path, monkeypatch, slab):
    """K not a multiple of the block (padded), an odd N, a weight read by two MatMuls, a MatMul on two activations, a
    weight used nowhere: the spilling quantiser against MatMulNBitsQuantizer, graph and bytes; each weight quantised
    whole from its file, or, read in the other order, a slab of 2 columns at a time (the last slab 1 column). (A weight of rank 3
    with a leading 1, which the quantiser squeezes and reshapes around, is left fp32 by the spilling one: no traced
    graph has one.)"""
    from onnx import TensorProto, helper

    from edgelin.exporters.precision.int4 import _int4_matmuls

    rng = np.random.default_rng(1)
    weights = {"w_odd": rng.standard_normal((45, 7)), "w_twice": rng.standard_normal((64, 33)),
               "unused": rng.standard_normal((40, 40))}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    nodes = [helper.make_node("MatMul", ["x45", "w_odd"], ["a"], name="mm_odd"),
             helper.make_node("MatMul", ["x64", "w_twice"], ["b"], name="mm_1"),
             helper.make_node("MatMul", ["x64", "w_twice"], ["c"], name=""),
             helper.make_node("MatMul", ["x64", "x64t"], ["d"], name="mm_act")]
    io = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    graph = helper.make_graph(nodes, "g", [io("x45", [3, 45]), io("x64", [3, 64]), io("x64t", [64, 3])],
                              [io("a", None), io("b", None), io("c", None), io("d", None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(proto, str(tmp_path / "g.onnx"), save_as_external_data=True, location="g.onnx.data", size_threshold=0)

    reference, _ = convert(onnx.load(str(tmp_path / "g.onnx")), "int4", embedding="fp32")
    from edgelin.exporters.weights import open_graph, tensor_values

    read = lambda t: tensor_values(t, tmp_path)  # noqa: E731
    if slab is not None:  # a weight read in the other order, as a traced graph's folded Transpose of a parameter is
        monkeypatch.setattr(common, "SLAB_BYTES", slab)  # K 45 and 64 are 2 blocks: 256 bytes a column
        read = lambda t: np.asfortranarray(tensor_values(t, tmp_path))  # noqa: E731
    ours = _int4_matmuls(open_graph(tmp_path / "g.onnx"), read, frozenset(), tmp_path / "g.q4")
    save_graph(ours, tmp_path / "g.onnx")
    ours = onnx.load(str(tmp_path / "g.onnx"))
    assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in reference.graph.node]
    assert sum(n.op_type == "MatMulNBits" for n in ours.graph.node) == 3
    assert [t.name for t in ours.graph.initializer] == [t.name for t in reference.graph.initializer]
    for a, b in zip(ours.graph.initializer, reference.graph.initializer):
        assert (a.name, a.data_type, list(a.dims)) == (b.name, b.data_type, list(b.dims))
        assert numpy_helper.to_array(a).tobytes() == numpy_helper.to_array(b).tobytes(), a.name
    assert [(o.domain, o.version) for o in ours.opset_import] == [(o.domain, o.version) for o in reference.opset_import]
