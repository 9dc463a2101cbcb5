"""Exported graphs in ONNX Runtime (CPU) against the PyTorch model, for every feature map.

fp32 budget (the project's one table, edgelin.parity.BUDGETS; the same for every check here):
    logits: max abs error <= 1e-4 and relative L2 error <= 1e-5.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from edgelin.config import FEATURE_MAPS
from edgelin.parity import budget
from edgelin.runtime.manifest import Manifest
from testkit import assert_within

CHUNK = 16  # the chunk of the tiny models exported by tests/exporters/conftest.py

LOGITS = budget("fp32", "logits")
REL_L2 = LOGITS["rel_l2"]


def assert_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert_within(got, ref, LOGITS, what)


class Graphs:
    """The two ORT sessions of an export, fed by manifest names."""

    def __init__(self, out):
        self.manifest = Manifest.load(out)
        self.sessions = {g: ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for g, f in self.manifest.graphs.items()}

    def run(self, graph, ids, state):
        ids = np.asarray(ids, np.int64)
        feeds = {self.manifest.input_ids: ids}
        if graph == "prefill":
            feeds.update(self.manifest.prefill_positions(*ids.shape))  # every position's logits
        feeds.update({s.input: state[s.input] for s in self.manifest.states})
        out = self.sessions[graph].run(None, feeds)
        return out[0], {s.input: v for s, v in zip(self.manifest.states, out[1:])}

    def fresh(self, batch):
        return {s.input: np.full(s.concrete_shape(batch), s.init, s.np_dtype) for s in self.manifest.states}


def torch_state_as_feeds(state, manifest):
    return {s.input: state[s.key].numpy() for s in manifest.states}


# every feature map without decay, and the decays (tests/test_decay_model.py tests them in PyTorch)
CASES = [pytest.param((fm, "none"), id=fm) for fm in FEATURE_MAPS] + [
    pytest.param(("relu", "fixed"), id="relu-decay-fixed"),
    pytest.param(("relu", "scalar"), id="relu-decay-scalar"),
    pytest.param(("relu", "gla"), id="relu-decay-gla"),
    pytest.param(("cosformer", "gla"), id="cosformer-decay-gla"),  # F = 2 head_dim and a position in the state
]


@pytest.fixture(params=CASES)
def case(request, exported):
    feature_map, decay = request.param
    model, out = exported(feature_map, **({} if decay == "none" else {"decay": decay}))
    assert model.cfg.chunk_size == CHUNK
    return model, Graphs(out)


@pytest.mark.parametrize("T", [pytest.param(t, id=f"T{t}") for t in (1, CHUNK - 1, CHUNK, CHUNK + 1, 1000)])
@pytest.mark.parametrize("batch", [1, 3], ids=["b1", "b3"])
def test_prefill_matches_torch(case, T, batch):
    model, g = case
    ids = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(T * 7 + batch))
    with torch.no_grad():
        ref, ref_state = model(ids)
    logits, state = g.run("prefill", ids.numpy(), g.fresh(batch))
    assert_close(logits, ref.numpy(), "logits")
    for s in g.manifest.states:
        r = ref_state[s.key].numpy()
        if s.dtype == "int64":
            np.testing.assert_array_equal(state[s.input], r)
        else:  # states are running sums: hold them to the same relative budget
            rel = np.linalg.norm(state[s.input] - r) / max(np.linalg.norm(r), 1e-30)
            assert rel <= REL_L2, f"{s.output}: relative L2 {rel:.2e}"


def test_decode_200_steps_matches_torch(case):
    model, g = case
    batch = 2
    ids = torch.randint(0, 256, (batch, 200), generator=torch.Generator().manual_seed(1))
    state_t = model.init_state(batch)
    state_o = g.fresh(batch)
    for t in range(200):
        with torch.no_grad():
            ref, state_t = model.step(ids[:, t : t + 1], state_t)
        logits, state_o = g.run("decode", ids[:, t : t + 1].numpy(), state_o)
        assert_close(logits, ref.numpy(), f"decode step {t}")


def test_prefill_continues_from_state(case):
    model, g = case
    ids = torch.randint(0, 256, (3, 2 * CHUNK + 5), generator=torch.Generator().manual_seed(2)).numpy()
    whole, whole_state = g.run("prefill", ids, g.fresh(3))
    a, state = g.run("prefill", ids[:, :CHUNK + 3], g.fresh(3))
    b, state = g.run("prefill", ids[:, CHUNK + 3 :], state)
    assert_close(np.concatenate([a, b], axis=1), whole, "prefill(a) + prefill(b, state) vs prefill(a+b)")
    for name in state:
        assert_close(state[name] / max(np.abs(whole_state[name]).max(), 1), whole_state[name] / max(np.abs(whole_state[name]).max(), 1), name)


def test_prefill_then_decode_matches_longer_prefill(case):
    model, g = case
    T, N = 2 * CHUNK + 1, 20
    ids = torch.randint(0, 256, (2, T + N), generator=torch.Generator().manual_seed(3)).numpy()
    whole, _ = g.run("prefill", ids, g.fresh(2))
    _, state = g.run("prefill", ids[:, :T], g.fresh(2))
    for t in range(T, T + N):
        logits, state = g.run("decode", ids[:, t : t + 1], state)
        assert_close(logits[:, 0], whole[:, t], f"decode at position {t}")


def test_decode_graph_has_no_chunk_machinery(exported):
    import onnx

    _, out = exported("elu+1")
    ops = {n.op_type for n in onnx.load(str(out / "decode.onnx")).graph.node}
    assert "CumSum" not in ops and "Pad" not in ops, sorted(ops)
    prefill_ops = {n.op_type for n in onnx.load(str(out / "prefill.onnx")).graph.node}
    assert "CumSum" in prefill_ops  # the chunked form really is in the prefill graph


@pytest.mark.parametrize("decay", ["none", "scalar"])
def test_decode_graph_is_lean(exported, decay, tmp_path):
    """ONNX Runtime pays a fixed cost per node at decode sizes, so the decode graph keeps the token axis
    (no Gather of token 0 beyond z's update, no Einsum, no head Transposes) and every RMSNorm is in the
    pattern ONNX Runtime fuses into one node when it loads the graph."""
    import onnx

    model, out = exported("relu", decay=decay)
    layers = model.cfg.n_layers
    ops = [n.op_type for n in onnx.load(str(out / "decode.onnx")).graph.node]
    assert "Einsum" not in ops
    assert ops.count("Gather") == 1 + layers  # the embedding, and phi(k) as z's [B, H, F] per layer
    assert ops.count("Transpose") == layers * (2 if decay == "scalar" else 1)  # phi(k) as a column (+ the gate's [B, H, 1])
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "loaded.onnx")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    ort.InferenceSession(str(out / "decode.onnx"), options, providers=["CPUExecutionProvider"])
    loaded = [n.op_type for n in onnx.load(str(tmp_path / "loaded.onnx"), load_external_data=False).graph.node]
    assert loaded.count("SimplifiedLayerNormalization") == 2 * layers + 1, sorted(set(loaded))
    assert "Sqrt" not in loaded and "Pow" not in loaded


def test_graph_io_follows_the_contract(exported):
    import onnx

    _, out = exported("cosformer")
    manifest = Manifest.load(out)
    for graph, fname in manifest.graphs.items():
        proto = onnx.load(str(out / fname))
        inputs = {i.name: i for i in proto.graph.input}
        outputs = {o.name: o for o in proto.graph.output}
        picked = [manifest.logits_at] if graph == "prefill" else []  # the positions whose logits the prefill graph returns
        assert list(inputs) == [manifest.input_ids] + picked + [s.input for s in manifest.states]
        assert list(outputs) == [manifest.logits] + [s.output for s in manifest.states]
        dims = [d.dim_param or d.dim_value for d in inputs[manifest.input_ids].type.tensor_type.shape.dim]
        assert dims == (["batch", "sequence"] if graph == "prefill" else ["batch", 1])
        logits_dims = [d.dim_param or d.dim_value for d in outputs[manifest.logits].type.tensor_type.shape.dim]
        assert logits_dims == (["batch", "positions", manifest.vocab_size] if graph == "prefill" else ["batch", 1, manifest.vocab_size])
        if picked:
            assert [d.dim_param or d.dim_value for d in inputs[manifest.logits_at].type.tensor_type.shape.dim] == ["batch", "positions"]
        for s in manifest.states:
            shape = [d.dim_param or d.dim_value for d in inputs[s.input].type.tensor_type.shape.dim]
            assert shape == list(s.shape), (graph, s.input, shape)
        meta = {p.key: p.value for p in proto.metadata_props}
        # the graph holds the manifest without the graph hashes (a file cannot hold its own); edgelin.json adds them
        on_disk = json.loads((out / "edgelin.json").read_text())
        hashes = on_disk.pop("sha256")
        assert json.loads(meta["edgelin"]) == on_disk
        assert hashes[graph] == hashlib.sha256((out / manifest.graphs[graph]).read_bytes()).hexdigest()
    assert [s.input for s in manifest.states] == [
        "state.0.S", "state.0.z", "state.0.pos", "state.0.conv", "state.1.S", "state.1.z", "state.1.pos", "state.1.conv",
    ]
