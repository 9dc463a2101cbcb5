"""What an fp16 export keeps in fp32, on small graphs with each pattern, through the fp16 conversion and ONNX Runtime:

- position angles (``exporters.precision.angle_region``): position x frequency rounded to fp16 is off by up to
  8 rad at position 16,384, which turns a rotary embedding into noise. RoPE's pattern (int64 positions -> Cast ->
  Mul by frequencies -> Cos / Sin -> times the activations) beside a Cos of a MatMul's output (not a position's
  angle: left in fp16);
- an L2 norm's statistic (``norm_region``): x * x summed, plus 1e-6, square root, the division (Gated DeltaNet's
  q and k), beside a square that is not summed (a squared feature map: left in fp16)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgelin.exporters import precision

FREQS = np.array([1.0, 0.1, 0.01], np.float32)  # RoPE's inv_freq: the first frequency of any RoPE is 1


def graph():
    nodes = [
        helper.make_node("Cast", ["pos"], ["pos_f"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Unsqueeze", ["pos_f", "axis"], ["pos_col"], name="unsq"),
        helper.make_node("Mul", ["pos_col", "freqs"], ["angle"], name="angle"),
        helper.make_node("Cos", ["angle"], ["cos"], name="cos"),
        helper.make_node("Sin", ["angle"], ["sin"], name="sin"),
        helper.make_node("Mul", ["x", "cos"], ["xc"], name="xc"),
        helper.make_node("Mul", ["x", "sin"], ["xs"], name="xs"),
        helper.make_node("Add", ["xc", "xs"], ["y"], name="y"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Cos", ["h"], ["h_cos"], name="act_cos"),  # a Cos of activations, not of positions
    ]
    g = helper.make_graph(
        nodes, "rope", [helper.make_tensor_value_info("pos", TensorProto.INT64, ["T"]), helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 3]), helper.make_tensor_value_info("h_cos", TensorProto.FLOAT, ["T", 3])],
        [numpy_helper.from_array(FREQS, "freqs"), numpy_helper.from_array(np.array([1], np.int64), "axis"),
         numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def run(proto, pos, x):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    half = next(i for i in sess.get_inputs() if i.name == "x").type == "tensor(float16)"  # the converter's choice
    return [np.asarray(a, np.float64) for a in sess.run(None, {"pos": pos, "x": x.astype(np.float16) if half else x})]


def test_the_angle_region_is_the_positions_path_only():
    assert precision.angle_region(graph().graph) == {"cast", "unsq", "angle", "cos", "sin"}


@pytest.mark.parametrize("start", [0, 1000, 16380])
def test_fp16_rotations_stay_exact_at_any_position(start, monkeypatch):
    pos = np.arange(start, start + 8, dtype=np.int64)
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(8, 3)
    angle = pos[:, None].astype(np.float64) * FREQS.astype(np.float64)
    ref = x * np.cos(angle) + x * np.sin(angle)  # float64
    converted, note = precision.convert(graph(), "fp16")
    y, h_cos = run(converted, pos, x)
    assert np.abs(y - ref).max() <= 2e-3  # fp16 rounding of cos/sin and of the products, nothing more
    assert any("position angles" in k for k in note.kept)
    types = {n.name: n for n in converted.graph.node}
    assert "act_cos" in types and np.abs(h_cos - np.cos(x)).max() <= 2e-3  # converted, and still right
    # the same conversion without the region: the rotation is lost far from position 0 (what the test guards)
    monkeypatch.setattr(precision.fp16, "angle_region", lambda g: set())
    y_lost, _ = run(precision.convert(graph(), "fp16")[0], pos, x)
    assert (np.abs(y_lost - ref).max() > 0.02) == (start >= 1000)  # 0.03 at 1,000; above 2,048 fp16 rounds positions to 2, 4, ...


def l2_graph():
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="sq"),
        helper.make_node("ReduceSum", ["sq", "last"], ["ss"], keepdims=1, name="sum"),
        helper.make_node("Add", ["ss", "eps"], ["ss_eps"], name="eps"),
        helper.make_node("Sqrt", ["ss_eps"], ["norm"], name="sqrt"),
        helper.make_node("Div", ["x", "norm"], ["y"], name="div"),
        helper.make_node("CumSum", ["y", "first"], ["c"], name="sum_over_tokens"),  # an fp32 running sum reads the unit vectors
        helper.make_node("Mul", ["x", "x"], ["feat"], name="feature"),  # a squared feature map, read by a MatMul
        helper.make_node("MatMul", ["feat", "w"], ["h"], name="proj"),
    ]
    g = helper.make_graph(
        nodes, "l2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 16])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["T", 16]), helper.make_tensor_value_info("h", TensorProto.FLOAT, ["T", 16])],
        [numpy_helper.from_array(np.array([-1], np.int64), "last"), numpy_helper.from_array(np.array(0, np.int64), "first"), numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
         numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def run_l2(proto, x):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    half = sess.get_inputs()[0].type == "tensor(float16)"
    return [np.asarray(a, np.float64) for a in sess.run(None, {"x": x.astype(np.float16) if half else x})]


def test_the_l2_norm_statistic_is_kept_and_a_plain_square_is_not():
    assert precision.norm_region(l2_graph().graph) == {"sq", "sum", "eps", "sqrt", "div"}


def test_fp16_l2_normalised_vectors_reach_a_running_sum_in_fp32(monkeypatch):
    """A delta rule multiplies its fp32 state by (I - beta k k^T) at every token: k must reach it with norm 1 to
    fp32's precision, not rounded to fp16 on the way (a norm off by ~1e-4 compounds over the tokens). A CumSum stands
    for the fp32 region. Checked on the converted graph's types: ONNX Runtime's CPU provider runs some fp16 ops in
    fp32 behind the graph's back (ops without an fp16 kernel), so its numbers here would not show the difference."""
    import onnx

    def types(proto):  # node name -> the element type of its output (the converter renames tensors, not nodes)
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        of = {v.name: v.type.tensor_type.elem_type for v in list(inferred.value_info) + list(inferred.output)}
        return {n.name: of[n.output[0]] for n in inferred.node if n.name}

    kept = types(precision.convert(l2_graph(), "fp16")[0])
    assert kept["div"] == kept["eps"] == kept["sum"] == TensorProto.FLOAT and kept["feature"] == TensorProto.FLOAT16
    monkeypatch.setattr(precision.fp16, "norm_region", lambda g: set())  # the same conversion without the region
    assert types(precision.convert(l2_graph(), "fp16")[0])["div"] == TensorProto.FLOAT16
    x = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    x16 = x.astype(np.float16).astype(np.float64)  # what the converted graph reads
    ref = np.cumsum(x16 / np.sqrt((x16 * x16).sum(-1, keepdims=True) + 1e-6), axis=0)
    monkeypatch.undo()
    c, _ = run_l2(precision.convert(l2_graph(), "fp16")[0], x)
    assert np.abs(c - ref).max() <= 1e-5
