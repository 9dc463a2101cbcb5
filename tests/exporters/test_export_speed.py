"""What the exporter changes in torch.onnx's own steps to export faster: each one must leave the graph as it was."""

from __future__ import annotations

import contextlib

import onnx
import onnx_ir as ir
import pytest
from onnxscript import rewriter

from edgelin.exporters import tracing as exporter

N_NODES = 120  # a chain of this many nodes beside the two Slices


def _graph() -> onnx.ModelProto:
    """Two Slices of X's last axis (the pattern of onnxscript's two-output rule SlicesSplit, which 0.7.2 pairs
    with the same Slice twice first and so leaves as it is) and a chain of N_NODES Relu / Neg nodes."""
    chain = ["c0 = Relu(Y)"] + [f"c{i} = {'Neg' if i % 2 else 'Relu'}(c{i - 1})" for i in range(1, N_NODES)]
    text = f"""
    <ir_version: 10, opset_import: ["" : 18]>
    g (float[4, 8] X, float[4, 8] Y) => (float[4, 4] S, float[4, 8] c{N_NODES - 1})
      <int64[1] b0 = {{0}}, int64[1] mid = {{4}}, int64[1] end = {{8}}, int64[1] axis = {{1}}> {{
        A = Slice (X, b0, mid, axis)
        B = Slice (X, mid, end, axis)
        S = Add (A, B)
        {chr(10).join(chain)}
    }}"""
    return onnx.parser.parse_model(text)


def _rewrite(prefiltered: bool, monkeypatch) -> tuple[bytes, int]:
    """The default rewrite rules on _graph(): the result, and how many times a graph was walked node by node."""
    walks = []
    original = ir.Graph.__iter__
    monkeypatch.setattr(ir.Graph, "__iter__", lambda self: walks.append(1) or original(self))
    model = ir.serde.deserialize_model(_graph())
    with exporter._rewriter_prefilter() if prefiltered else contextlib.nullcontext():
        rewriter.RewritePass(rewriter._DEFAULT_REWRITE_RULES)(model)
    monkeypatch.setattr(ir.Graph, "__iter__", original)
    return ir.serde.serialize_model(model).SerializeToString(), len(walks)


def test_the_rewriter_prefilter_rewrites_the_same_and_walks_the_graph_a_constant_number_of_times(monkeypatch):
    plain, plain_walks = _rewrite(False, monkeypatch)
    fast, fast_walks = _rewrite(True, monkeypatch)
    assert fast == plain  # the same model, byte for byte
    # onnxscript 0.7 walks the whole graph once per node for that rule: quadratic; with the prefilter only at the
    # two Slices. (If a later onnxscript no longer does so, plain_walks drops and this says the prefilter is moot.)
    assert plain_walks >= N_NODES, f"onnxscript walks the graph {plain_walks} times: the prefilter may be moot now"
    assert 2 <= fast_walks <= 10, fast_walks  # the rule is still tried at the Slices: once per Slice and pass


def test_the_prefilter_and_the_tracer_settings_are_undone_after_an_export_step():
    import torch
    from onnxscript.rewriter import _matcher

    match = _matcher.SimplePatternMatcher.match
    cache = torch._dynamo.config.fake_tensor_cache_enabled
    with exporter._rewriter_prefilter(), exporter._tracer_settings():
        assert _matcher.SimplePatternMatcher.match is not match
        assert torch._dynamo.config.fake_tensor_cache_enabled is False
    assert _matcher.SimplePatternMatcher.match is match
    assert torch._dynamo.config.fake_tensor_cache_enabled is cache
    with pytest.raises(RuntimeError), exporter._rewriter_prefilter(), exporter._tracer_settings():
        raise RuntimeError("a failed trace")
    assert _matcher.SimplePatternMatcher.match is match
    assert torch._dynamo.config.fake_tensor_cache_enabled is cache
