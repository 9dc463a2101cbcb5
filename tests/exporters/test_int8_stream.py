"""The int8 quantiser that reads one weight at a time (``precision.int8_file``) against ONNX Runtime's own
``quantize_dynamic`` with the settings edgelin used before (MatMul, per channel, reduce_range, QInt8): the same int8
weights and scales bit for bit, and graphs that compute the same numbers, on a graph built to have the awkward
cases (an activation read by several MatMuls, a weight read twice, a column of zeros, a 3-D activation, a MatMul on
two activations) and on a real exported graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin.exporters.precision.int8 import _quantise_matmuls, quantise_int8_columns
from edgelin.exporters.weights import tensor_values


def _reference(src, dst) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=True, weight_type=QuantType.QInt8,
                     use_external_data_format=True)
    return onnx.load(str(dst))


def _ours(src) -> onnx.ModelProto:
    proto = onnx.load(str(src), load_external_data=False)
    _quantise_matmuls(proto.graph, lambda t: tensor_values(t, src.parent))
    for t in proto.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            t.CopyFrom(numpy_helper.from_array(tensor_values(t, src.parent), t.name))
    return proto


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _quantised(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    """MatMulInteger weight -> (int8 values, scales) of ``proto``, keyed by the fp32 weight's position of use."""
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    out = []
    for n in proto.graph.node:
        if n.op_type == "MatMulInteger":
            scale_mul = next(m for m in proto.graph.node if m.op_type == "Mul" and m.output[0] in
                             [k.input[1] for k in proto.graph.node if k.op_type == "Mul" and k.input[0].startswith(n.output[0])])
            out.append((inits[n.input[1]], inits[scale_mul.input[1]]))
    return out


def test_columns_quantise_as_onnx_runtime_does():
    from onnxruntime.quantization.quant_utils import quantize_data

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 40)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0  # a column of zeros: scale 1, as ONNX Runtime sets it
    w[:, 5] = np.float32(1e-39)  # subnormal: below float32's tiny
    w[7, 9] = 0.5 * np.abs(w[:, 9]).max() / 64 * 3  # a value that rounds half to even
    q, scale = quantise_int8_columns(w)
    for c in range(w.shape[1]):
        zp, s, qc = quantize_data(w[:, c], TensorProto.INT8, True, reduce_range=True)
        assert zp == 0 and np.float32(s) == scale[c] and np.array_equal(qc, q[:, c]), c
    assert scale[3] == 1.0 and q.min() >= -64 and q.max() <= 64


def test_the_awkward_graph_equals_quantize_dynamic(tmp_path):
    rng = np.random.default_rng(1)
    D, H = 48, 40
    w1 = (rng.standard_normal((D, H)) * 0.1).astype(np.float32)
    w1[:, 2] = 0
    w2 = (rng.standard_normal((D, D)) * 0.1).astype(np.float32)
    w3 = (rng.standard_normal((H, D)) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),  # x read by three MatMuls
        helper.make_node("MatMul", ["x", "w2"], ["b"]),
        helper.make_node("MatMul", ["x", "w1"], ["c"]),  # w1 read twice
        helper.make_node("Relu", ["a"], ["ra"]),
        helper.make_node("MatMul", ["ra", "w3"], ["d"]),
        helper.make_node("MatMul", ["b", "bt"], ["e"]),  # two activations: left alone
        helper.make_node("Transpose", ["b"], ["bt"], perm=[0, 2, 1]),
    ]
    nodes = nodes[:5] + [nodes[6], nodes[5]]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "t", D])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "t", k]) for n, k in (("a", H), ("b", D), ("c", H), ("d", D), ("e", "t"))],
        [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))],
    )
    src = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9), str(src), save_as_external_data=True,
              location="g.onnx.data", size_threshold=0)
    ref, ours = _reference(src, tmp_path / "ref.onnx"), _ours(src)
    assert {n.op_type for n in ours.graph.node} == {n.op_type for n in ref.graph.node}
    assert sum(n.op_type == "DynamicQuantizeLinear" for n in ours.graph.node) == 2  # one per activation
    assert sum(n.op_type == "MatMulInteger" for n in ours.graph.node) == 4 and sum(n.op_type == "MatMul" for n in ours.graph.node) == 1
    assert not {"w1", "w2", "w3"} & {t.name for t in ours.graph.initializer}  # fp32 weights no longer read are gone
    onnx.checker.check_model(ours, full_check=True)
    x = rng.standard_normal((2, 5, D)).astype(np.float32)
    for got, want in zip(_run(ours, {"x": x}), _run(ref, {"x": x})):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("graph", ["prefill", "decode"])
def test_an_exported_graph_equals_quantize_dynamic(exported, tmp_path, graph):
    """The tiny model's fp32 graph (weights in weights.data beside it): the same int8 weights and scales, and the
    same logits and states bit for bit on random ids."""
    _, out = exported("elu+1")
    src = out / f"{graph}.onnx"
    ref, ours = _reference(src, tmp_path / "ref.onnx"), _ours(src)
    a, b = _quantised(ours), _quantised(ref)
    assert len(a) == len(b) > 4
    for (qa, sa), (qb, sb) in zip(a, b):
        assert np.array_equal(qa, qb) and np.array_equal(sa, sb)
    sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else (2 if k == 0 else 7 if graph == "prefill" else 1) for k, d in enumerate(i.shape)]
        feeds[i.name] = rng.integers(0, 256, shape) if "int64" in i.type else rng.standard_normal(shape).astype(np.float32) * 0.1
    for got, want in zip(_run(ours, feeds), _run(ref, feeds)):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("scheme", ["channel", "block"])
def test_slabs_and_the_spill_file_give_the_same_bytes(tmp_path, monkeypatch, scheme):
    """``int8_file`` quantises each weight a slab of columns at a time (here 2 columns a slab, the last one 1) and writes it
    to its spill file as made: after ``save_graph``, the same nodes and initializers, byte for byte, as the whole weights
    quantised inline; and the slab quantisers give the whole one's numbers for a weight read in the other order (a
    deferred weight is the transposed view of a parameter), K not a multiple of the block, N odd."""
    from edgelin.exporters.precision import common, int8_file
    from edgelin.exporters.precision.int8 import int8_blocks_by_slabs, int8_columns_by_slabs, quantise_int8_blocks
    from edgelin.exporters.weights import save_graph

    rng = np.random.default_rng(3)
    ws = {"w_odd": rng.standard_normal((45, 7)), "w_wide": rng.standard_normal((64, 33)) * 0.1}
    ws["w_wide"][:, 4] = 0.0
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in ws.items()]
    nodes = [helper.make_node("MatMul", ["x45", "w_odd"], ["a"], name="mm_odd"), helper.make_node("MatMul", ["x64", "w_wide"], ["b"], name="mm_wide"),
             helper.make_node("MatMul", ["x64", "w_wide"], ["c"], name="mm_again")]
    io = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    graph = helper.make_graph(nodes, "g", [io("x45", [3, 45]), io("x64", [3, 64])], [io("a", None), io("b", None), io("c", None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(tmp_path / "g.onnx"), save_as_external_data=True,
              location="g.onnx.data", size_threshold=0)
    whole = onnx.load(str(tmp_path / "g.onnx"), load_external_data=False)
    _quantise_matmuls(whole.graph, lambda t: tensor_values(t, tmp_path), scheme)
    monkeypatch.setattr(common, "SLAB_BYTES", 4 * 64 * 2)  # 2 columns of K 64 (or of 2 blocks of 32); K 45: 2 columns as well
    ours, note = int8_file(tmp_path / "g.onnx", "fp32", scheme)
    assert note.spilled == tmp_path / "g.onnx.q8" and note.spilled.stat().st_size > 0
    assert any(t.data_location == TensorProto.EXTERNAL and str(note.spilled) in [e.value for e in t.external_data] for t in ours.graph.initializer)
    save_graph(ours, tmp_path / "g.onnx")
    note.spilled.unlink()
    ours = onnx.load(str(tmp_path / "g.onnx"))
    assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in whole.graph.node]
    got = {t.name: numpy_helper.to_array(t) for t in ours.graph.initializer}
    assert list(got) == [t.name for t in whole.graph.initializer]
    for t in whole.graph.initializer:
        want = numpy_helper.to_array(t) if t.data_location != TensorProto.EXTERNAL else tensor_values(t, tmp_path)
        assert got[t.name].dtype == want.dtype and got[t.name].tobytes() == np.ascontiguousarray(want).tobytes(), t.name
    for w in ws.values():
        f = np.asfortranarray(w.astype(np.float32))
        for a, b in zip(int8_columns_by_slabs(f), quantise_int8_columns(w.astype(np.float32))):
            assert np.array_equal(a, b)
        for a, b in zip(int8_blocks_by_slabs(f), quantise_int8_blocks(w.astype(np.float32))):
            assert np.array_equal(a, b)
