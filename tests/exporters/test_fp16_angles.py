"""fp16 exports keep position angles in fp32 (``exporters.precision.angle_region``): position x frequency rounded
to fp16 is off by up to 8 rad at position 16,384, which turns a rotary embedding into noise. A small graph with
RoPE's pattern (int64 positions -> Cast -> Mul by frequencies -> Cos / Sin -> times the activations) and a Cos of
a MatMul's output (not a position's angle: left in fp16) goes through the fp16 conversion and ONNX Runtime."""

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
    monkeypatch.setattr(precision, "angle_region", lambda g: set())
    y_lost, _ = run(precision.convert(graph(), "fp16")[0], pos, x)
    assert (np.abs(y_lost - ref).max() > 0.02) == (start >= 1000)  # 0.03 at 1,000; above 2,048 fp16 rounds positions to 2, 4, ...
