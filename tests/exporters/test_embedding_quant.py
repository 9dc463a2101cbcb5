"""int8/int4 exports block-quantise the token embedding and a tied head from one table, stored once.

The table quantiser is held to a naive per-element float64 loop; the rewritten graph (GatherBlockQuantized + a
MatMulNBits head on the same bytes) is run by ONNX Runtime and held to the dequantised table; a table that cannot
be blocked, or that the user keeps, stays fp32 and the notes say why; the bundled model's int4 export stores the
table once for both readers.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin.errors import ExportError
from edgelin.exporters import export
from edgelin.exporters.precision import TABLE_BLOCK, convert, dequantise_table, quantise_table
from testkit.quant import int8_blocks


def _naive_quantise(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """One block, one element at a time, in float64: the definition quantise_table implements."""
    V, D = w.shape
    qmax, zero = 2 ** (bits - 1) - 1, 2 ** (bits - 1)
    codes = np.zeros((V, D), np.int64)
    scales = np.zeros((V, D // block), np.float32)
    for v in range(V):
        for b in range(D // block):
            values = [float(x) for x in w[v, b * block:(b + 1) * block]]
            scale = np.float32(max(abs(x) for x in values) / qmax) or np.float32(1.0)
            scales[v, b] = scale
            for j, x in enumerate(values):
                codes[v, b * block + j] = min(max(round(x / float(scale)), -qmax - 1), qmax) + zero
    if bits == 8:
        return codes.astype(np.uint8), scales
    return (codes[:, 0::2] + 16 * codes[:, 1::2]).astype(np.uint8), scales


@pytest.mark.parametrize("bits", [4, 8])
def test_table_quantiser_matches_the_naive_loop(bits):
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((37, 96)) * rng.uniform(0.01, 3, (37, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero row: scale 1, codes at the zero point
    w[5, :32] = 1e-30
    packed, scales = quantise_table(w, bits, rows=10)  # row pieces that do not divide V
    ref_packed, ref_scales = _naive_quantise(w, bits, TABLE_BLOCK)
    # rint (half to even) and Python's round agree; the float32 division may differ from float64's in the last
    # bit, which moves a code only at an exact .5: none in random data
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(packed, ref_packed)
    deq = dequantise_table(packed, scales, bits)
    np.testing.assert_array_equal(dequantise_table(packed, scales, bits, rows=10), deq)  # in row pieces: the same values
    step = np.repeat(scales, TABLE_BLOCK, axis=1)
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6))
    assert np.all(deq[3] == 0.0)


def _tied_graph(V: int, D: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """input_ids -> Gather(E) -> x; x @ Transpose(E) -> logits: a tied embedding and head, as torch.onnx writes
    one for a large vocabulary."""
    E = np.random.default_rng(seed).standard_normal((V, D)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["model.embed.weight", "input_ids"], ["x"], name="node_embedding"),
        helper.make_node("Transpose", ["model.embed.weight"], ["head_w"], name="node_permute", perm=[1, 0]),
        helper.make_node("MatMul", ["x", "head_w"], ["logits"], name="node_head"),
    ]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", V])],
                              [numpy_helper.from_array(E, "model.embed.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), E


def _run(proto: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]


def _run_gather(proto: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    """The Gather's output (the embedded rows) of a graph whose first node is the embedding."""
    with_rows = onnx.ModelProto()
    with_rows.CopyFrom(proto)
    with_rows.graph.output.append(helper.make_tensor_value_info(proto.graph.node[0].output[0], TensorProto.FLOAT, None))
    sess = ort.InferenceSession(with_rows.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([proto.graph.node[0].output[0]], {"input_ids": ids})[0]


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("embedding", ["int8", "int4"])
def test_tied_embedding_and_head_read_one_quantised_table(precision, embedding):
    V, D = 300, 64
    proto, E = _tied_graph(V, D)
    out, note = convert(proto, precision, embedding=embedding)
    ops = [n.op_type for n in out.graph.node]
    assert ops == ["GatherBlockQuantized", "MatMulNBits"], ops  # no Transpose, no fp32 Gather or MatMul
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    assert "model.embed.weight" not in inits
    gather, head = out.graph.node
    bits = {"int8": 8, "int4": 4}[embedding]
    assert {a.name: a.i for a in gather.attribute} == {"gather_axis": 0, "quantize_axis": 1, "block_size": TABLE_BLOCK, "bits": bits}
    # the head computes with int8 activations (accuracy_level 4): ONNX Runtime's fp32-activation kernel for 8-bit
    # weights is ~100x slower, for 4-bit ~5x (precision.ACCURACY_LEVEL)
    assert {a.name: a.i for a in head.attribute} == {"K": D, "N": V, "bits": bits, "block_size": TABLE_BLOCK, "accuracy_level": 4}
    # the head's weight and scales are the Gather's bytes (the weights file stores them once)
    assert inits[head.input[1]].tobytes() == inits[gather.input[0]].tobytes()
    assert inits[head.input[2]].tobytes() == inits[gather.input[2]].tobytes()
    assert not note.kept
    ids = np.array([[0, 7, 299, 150], [3, 3, 1, 298]], np.int64)
    deq = dequantise_table(inits[gather.input[0]], inits[gather.input[2]], bits).astype(np.float64)
    got = _run(out, ids)
    np.testing.assert_array_equal(_run_gather(out, ids), deq[ids].astype(np.float32))  # the rows: exactly the table's
    # the head at accuracy_level 4: its input quantised to int8 per block of 32 (symmetric, max |x| / 127), times
    # the dequantised table
    ref = int8_blocks(deq[ids]) @ deq.T
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    exact = E.astype(np.float64)[ids] @ E.astype(np.float64).T
    err = np.abs(got - exact).max() / np.abs(exact).max()
    assert err < {8: 0.01, 4: 0.15}[bits]  # and it is the table it claims to be


def test_a_table_kept_in_fp32_is_said_to_be_kept_and_why():
    proto, E = _tied_graph(64, 40)  # 40 is not a multiple of the block
    out, note = convert(proto, "int4")
    assert [n.op_type for n in out.graph.node] == ["Gather", "Transpose", "MatMul"]
    assert "embedding Gather model.embed.weight (fp32: d_model 40 is not a multiple of the block 32; shared with the tied head)" in note.kept
    assert any(k.startswith("MatMul node_head (fp32: the tied head") for k in note.kept)
    ids = np.array([[1, 2, 63]], np.int64)
    np.testing.assert_allclose(_run(out, ids), E[ids] @ E.T, rtol=1e-5, atol=1e-5)
    kept, note = convert(_tied_graph(64, 64)[0], "int8", embedding="fp32")
    assert [n.op_type for n in kept.graph.node] == ["Gather", "Transpose", "MatMul"]
    assert "embedding Gather model.embed.weight (fp32: --embedding fp32; shared with the tied head)" in note.kept


def test_embedding_choice_is_refused_where_it_does_not_apply(exported, tmp_path):
    model, _ = exported("elu+1")
    with pytest.raises(ExportError, match="--embedding applies to int8 and int4 exports"):
        export(model, tmp_path / "out", precision="fp16", embedding="int4")
    with pytest.raises(ExportError, match="choose one of int8, int4, fp32"):
        export(model, tmp_path / "out", precision="int4", embedding="int2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_bundled_int4_export_stores_its_tied_table_once(bundled_export):
    """The bundled model's graphs read the embedding transposed for the head (torch keeps the Transpose): both
    readers point at one stretch of weights.data, and the table is 8-bit (the default)."""
    out = bundled_export("int4")
    for graph in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(out / graph), load_external_data=False)
        where = {i.name: {e.key: e.value for e in i.external_data} for i in proto.graph.initializer if i.external_data}
        gather = next(n for n in proto.graph.node if n.op_type == "GatherBlockQuantized")
        heads = [n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{gather.input[0]}_head"]
        assert len(heads) == 1, graph
        assert where[heads[0].input[1]]["offset"] == where[gather.input[0]]["offset"]
        assert where[heads[0].input[2]]["offset"] == where[gather.input[2]]["offset"]
        assert not any(n.op_type == "Transpose" and n.input[0] == "model.embed.weight" for n in proto.graph.node)
    kept = json.loads((out / "edgelin.json").read_text())["precision_kept"]
    assert not any("embedding" in k or "tied head" in k for notes in kept.values() for k in notes), kept
