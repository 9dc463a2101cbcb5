"""int8's block scheme (``--int8-scheme block``): every constant-weight MatMul as MatMulNBits, 8 bits, blocks of 32
along K (llama.cpp's Q8_0), activations quantised per block.

The block quantiser is held to a naive per-column loop in float64 (K not a multiple of the block: zero padding);
the rewritten MatMul, run by ONNX Runtime, to what MatMulNBits computes at accuracy_level 4 written out in numpy;
the tiny model's export to its graph structure and manifest; the bundled model's to int8's budgets, to being closer
to fp32 than the per-channel scheme (what the scheme is for), and a broken block scale to failing validate.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from edgelin.errors import ExportError
from edgelin.exporters import export
from edgelin.exporters.precision import INT8_BLOCK, convert, quantise_int8_blocks
from testkit import rel_l2
from testkit.quant import int8_blocks


def _naive_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Column n of the [K, N] weight, block b of it (zero-padded past K), one value at a time in float64:
    scale = max |value| / 127 (1 where all are 0), code = round(value / scale) + 128."""
    K, N = w.shape
    blocks = -(-K // block)
    codes = np.full((N, blocks, block), 128, np.uint8)
    scales = np.zeros((N, blocks), np.float32)
    for n in range(N):
        for b in range(blocks):
            values = [float(w[k, n]) for k in range(b * block, min(K, (b + 1) * block))]
            scale = np.float32(max(abs(v) for v in values) / 127) or np.float32(1.0)
            scales[n, b] = scale
            for j, v in enumerate(values):
                codes[n, b, j] = min(max(round(v / float(scale)), -128), 127) + 128
    return codes, scales.reshape(-1)


@pytest.mark.parametrize("K", [1, 31, 32, 33, 96, 101])
def test_block_quantiser_matches_the_naive_loop(K):
    rng = np.random.default_rng(K)
    N = 7
    w = (rng.standard_normal((K, N)) * rng.uniform(0.01, 3, (1, N))).astype(np.float32)
    w[:, 2] = 0.0  # an all-zero column: scale 1, codes at the zero point
    packed, scales = quantise_int8_blocks(w)
    codes, ref_scales = _naive_blocks(w, INT8_BLOCK)
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(packed, codes)
    deq = ((packed.astype(np.float32) - 128) * scales.reshape(N, -1, 1)).reshape(N, -1)[:, :K].T
    assert np.all(np.abs(deq - w) <= np.repeat(scales.reshape(N, -1), INT8_BLOCK, axis=1)[:, :K].T / 2 * (1 + 1e-6))


def _matmul_graph(K: int, N: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    """x [batch, T, K] -> x @ W [K, N] -> y, and a second MatMul reading the same x and W (quantised once)."""
    W = (np.random.default_rng(seed).standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="node_a"), helper.make_node("MatMul", ["x", "W"], ["y2"], name="node_b")]
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", K])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", "T", N]) for o in ("y", "y2")],
                              [numpy_helper.from_array(W, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), W


@pytest.mark.parametrize(("K", "N", "T"), [(64, 24, 1), (40, 24, 5), (33, 1, 3), (101, 17, 7)])
def test_a_block_quantised_matmul_computes_what_matmulnbits_defines(K, N, T):
    proto, W = _matmul_graph(K, N)
    out, note = convert(proto, "int8", int8_scheme="block")
    assert [n.op_type for n in out.graph.node] == ["MatMulNBits", "MatMulNBits"] and not note.kept
    attrs = {a.name: a.i for a in out.graph.node[0].attribute}
    assert attrs == {"K": K, "N": N, "bits": 8, "block_size": INT8_BLOCK, "accuracy_level": 4}
    inits = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    assert set(inits) == set(out.graph.node[0].input[1:]) == set(out.graph.node[1].input[1:])  # W quantised once, dropped
    packed, scales = inits[out.graph.node[0].input[1]], inits[out.graph.node[0].input[2]]
    blocks = -(-K // INT8_BLOCK)
    deq = ((packed.astype(np.float64) - 128) * scales.reshape(N, blocks, 1)).reshape(N, -1)  # [N, K padded]
    x = np.random.default_rng(1).standard_normal((2, T, K)).astype(np.float32)
    y, y2 = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, y2)
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (0, blocks * INT8_BLOCK - K)))
    ref = int8_blocks(padded) @ deq.T  # activations rounded per block of 32, times the dequantised weight
    assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
    assert rel_l2(y, x.astype(np.float64) @ W.astype(np.float64)) < 0.01  # and it is the weight it claims to be


def test_the_scheme_is_refused_where_it_does_not_apply(exported, tmp_path):
    model, _ = exported("elu+1")
    with pytest.raises(ExportError, match="--int8-scheme applies to int8 exports only"):
        export(model, tmp_path / "out", precision="int4", int8_scheme="block")
    with pytest.raises(ExportError, match="choose one of channel, block"):
        export(model, tmp_path / "out", precision="int8", int8_scheme="q8")
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_it_in_one_line(tmp_path):
    from edgelin.cli import main

    result = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "out"), "--precision", "fp16", "--int8-scheme", "block"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "--int8-scheme applies to int8 exports only" in result.output
    assert not (tmp_path / "out").exists()


def test_the_tiny_models_block_export(exported):
    _, out = exported("elu+1", options={"precision": "int8", "int8_scheme": "block"})
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["precision"] == "int8" and manifest["int8_scheme"] == "block"
    for graph in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(out / graph), load_external_data=False)
        ops = {n.op_type for n in proto.graph.node}
        assert "MatMulNBits" in ops and not ops & {"MatMulInteger", "DynamicQuantizeLinear"}, sorted(ops)
        kept = manifest["precision_kept"][graph.split(".")[0]]
        assert all("no constant weight" in k for k in kept), kept  # every constant-weight MatMul is quantised
    _, channel = exported("elu+1", options={"precision": "int8"})
    assert json.loads((channel / "edgelin.json").read_text())["int8_scheme"] == "channel"


# ---- the bundled model ---------------------------------------------------------------------------------
def _heldout_logits(export_dir, windows: int = 4, length: int = 256) -> np.ndarray:
    from edgelin.runtime.session import Session
    from edgelin.validate import heldout_text

    session = Session(export_dir, "cpu", threads=1)
    text = heldout_text(session.manifest)
    ids = np.frombuffer(text[: windows * length], np.uint8).astype(np.int64).reshape(windows, length)
    return session.prefill(ids, session.new_state(windows)).astype(np.float64)


@pytest.mark.slow
def test_block_int8_is_closer_to_fp32_than_per_channel(bundled_export):
    """What the scheme is for. Measured (4 held-out windows of 256 bytes, prefill logits against the fp32 export):
    rel L2 0.0040 (block) against 0.0256 (channel); validate's tables agree (prefill rel L2 0.008-0.010 against
    0.027-0.032, decode 0.043 against 0.086; held-out bits/byte delta -0.0002 against +0.0009)."""
    fp32 = _heldout_logits(bundled_export("fp32"))
    block = rel_l2(_heldout_logits(bundled_export("int8", int8_scheme="block")), fp32)
    channel = rel_l2(_heldout_logits(bundled_export("int8")), fp32)
    assert block < channel / 2, (block, channel)


def test_compare_exports_times_each_export(exported, capsys):
    """scripts/compare_exports.py (the README's timing of the two schemes) runs every export it is given, every round."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("compare_exports", Path(__file__).parents[2] / "scripts" / "compare_exports.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, block = exported("elu+1", options={"precision": "int8", "int8_scheme": "block"})
    _, channel = exported("elu+1", options={"precision": "int8"})
    script.main([str(block), str(channel), "--threads", "1,2", "--rounds", "2", "--steps", "3", "--prefill", "20"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("ms/token" in line and "prefill 20:" in line for line in lines), lines
    assert all(line.count(",") >= 1 for line in lines)  # two rounds' figures beside each median
    with pytest.raises(SystemExit, match="must be at least 1"):
        script.main([str(block), "--rounds", "0"])


def test_the_default_scheme_follows_the_checkpoints_framework():
    """block for a transformers checkpoint (trained hybrids' activations: exporters/precision.py), channel for edgelin's
    own and fla's; a scheme named is kept; other precisions have none."""
    from edgelin.exporters.precision import int8_scheme_choice

    assert int8_scheme_choice("int8", None, "transformers") == "block"
    assert int8_scheme_choice("int8", None, None) == int8_scheme_choice("int8", None, "fla") == "channel"
    assert int8_scheme_choice("int8", "channel", "transformers") == "channel"
    assert int8_scheme_choice("int4", None, "transformers") is None
