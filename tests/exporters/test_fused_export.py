"""``edgelin export --ops fused``: the graphs with ONNX Runtime's LinearAttention node, against the portable graphs,
against PyTorch, in every precision.

- The bundled model (relu map with the denominator, a per-head decay, a short conv): the fused export holds the
  same state contract as the portable one, its graphs give the portable graphs' logits and states (a 150-token
  prefill of two rows, then 24 decode steps fed back) within the fp32 logits and state budgets, one
  LinearAttention and one CausalConvWithState node per layer in each graph (the decay's softplus one Softplus
  node), and ``validate`` passes on it (every check).
- Tiny models of the other update rules (GLA's per-feature decay, Gated DeltaNet, DeltaNet, no denominator with a
  fixed decay, a hybrid with a softmax-attention layer) export fused with the smoke check on (both graphs against
  PyTorch within the fp32 budget); the fused graphs continue the portable export's state.
- fp16, int8 and int4 exports of a fused Gated DeltaNet pass their smoke checks within their precision's budgets.
(The transformers families are held to transformers itself in fused form in tests/importers/test_hf_*.py.)
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from conftest import tiny_model
from edgelin import parity
from edgelin.layers.linear_attention import ShortConv
from edgelin.runtime import load

BUDGET = parity.held("fp32", {})[0]


def _ops(folder) -> dict[str, dict[str, int]]:
    out = {}
    for graph in ("prefill", "decode"):
        counts: dict[str, int] = {}
        for node in onnx.load(str(folder / f"{graph}.onnx"), load_external_data=False).graph.node:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
        out[graph] = counts
    return out


def _run(folder, prompt: np.ndarray, steps: np.ndarray, state=None):
    """Logits of a prefill of ``prompt`` and of each token of ``steps`` (decode), and the final state, as numpy."""
    session = load(folder, provider="cpu")
    state = session.new_state(prompt.shape[0]) if state is None else state
    logits = [session.prefill(prompt, state)]
    for t in range(steps.shape[1]):
        logits.append(session.decode(steps[:, t : t + 1], state))
    return logits, state


def _agree(got, ref, what: str) -> None:
    errors = parity.errors(got, ref)
    assert parity.within(errors, BUDGET["logits"]), f"{what}: {errors}"


@pytest.fixture(scope="session")
def bundled_fused(export_cache):
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint

    checkpoint = bundled_checkpoint()
    if checkpoint is None:
        pytest.skip("this install has no bundled model")
    return checkpoint, export_cache.get("bundled-fused", {"checkpoint": str(checkpoint), "ops": "fused"},
                                        lambda folder: export(checkpoint, folder, ops="fused"))


def test_the_bundled_model_fused_equals_portable(bundled_fused, bundled_exports):
    checkpoint, fused_dir = bundled_fused
    portable_dir = bundled_exports("fp32")
    fused_manifest = json.loads((fused_dir / "edgelin.json").read_text())
    portable_manifest = json.loads((portable_dir / "edgelin.json").read_text())
    assert fused_manifest["ops"] == "fused" and "ops" not in portable_manifest
    assert fused_manifest["states"] == portable_manifest["states"] and fused_manifest["io"] == portable_manifest["io"]
    layers = portable_manifest["model"]["n_layers"]
    for graph, counts in _ops(fused_dir).items():
        assert counts.get("LinearAttention") == layers, (graph, counts)
        assert counts.get("CausalConvWithState") == layers and "Conv" not in counts, (graph, counts)  # the short convs
        assert counts.get("Softplus") == layers and not {"Greater", "Where"} & set(counts), (graph, counts)  # the decays' softplus
        assert not {"Loop", "Scan", "If"} & set(counts), (graph, counts)
    assert all(not {"LinearAttention", "CausalConvWithState"} & set(counts) for counts in _ops(portable_dir).values())

    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, 256, (2, 150)), rng.integers(0, 256, (2, 24))
    got, got_state = _run(fused_dir, prompt, steps)
    ref, ref_state = _run(portable_dir, prompt, steps)
    for t, (a, b) in enumerate(zip(got, ref)):
        _agree(a, b, "prefill" if t == 0 else f"decode step {t}")
    for name, value in ref_state.numpy().items():
        errors = parity.errors(got_state.numpy()[name], value)
        assert parity.within(errors, BUDGET["state"]), f"state {name}: {errors}"


def test_validate_passes_on_the_fused_bundled_export(bundled_fused):
    from edgelin.validate import validate

    checkpoint, fused_dir = bundled_fused
    report = validate(fused_dir, checkpoint, steps=16, long=200)
    assert report.passed, report.table()


TINY = {  # id -> (feature map, config overrides): one per update rule / decay / layer kind
    "gla-feature-decay": ("elu+1", {"decay": "gla"}),
    "gated-deltanet": ("identity", {"update": "delta", "decay": "scalar"}),
    "deltanet": ("relu", {"update": "delta", "normalisation": "none"}),
    "retnet-noden": ("identity", {"decay": "fixed"}),
    "hybrid-attn1": ("elu+1", {"decay": "scalar", "attn_layers": (1,)}),
}
# The portable reference's options where no other test reads its export: Gated DeltaNet's prefill scan built for 64
# tokens (2 levels, not the default 4,096's 8: a faster trace), above the 37-token prompt it is given. DeltaNet's
# portable export is the one tests/exporters/test_trace_cache.py reads at the default bound.
PORTABLE = {"gated-deltanet": {"max_sequence": 64}}


@pytest.mark.parametrize("case", list(TINY))
def test_tiny_models_export_fused_and_continue_the_portable_state(case, exported):
    feature_map, overrides = TINY[case]
    model, fused_dir = exported(feature_map, options={"ops": "fused", "check": True}, **overrides)  # smoke check: vs PyTorch
    _, portable_dir = exported(feature_map, options=PORTABLE.get(case), **overrides)
    counts = _ops(fused_dir)
    linear_layers = model.cfg.n_layers - len(model.cfg.attn_layers)
    assert counts["decode"].get("LinearAttention") == linear_layers and counts["prefill"].get("LinearAttention") == linear_layers
    convs = sum(isinstance(m, ShortConv) for m in model.modules())
    assert convs and counts["decode"].get("CausalConvWithState") == convs == counts["prefill"].get("CausalConvWithState"), counts
    rng = np.random.default_rng(1)
    prompt, steps = rng.integers(0, 256, (2, 37)), rng.integers(0, 256, (2, 6))
    _, state = _run(portable_dir, prompt, steps[:, :0])  # the portable prefill's state ...
    got, _ = _run(fused_dir, steps[:, :3], steps[:, 3:], state=state)  # ... continued by the fused graphs
    ref, _ = _run(portable_dir, steps[:, :3], steps[:, 3:], state=_run(portable_dir, prompt, steps[:, :0])[1])
    for t, (a, b) in enumerate(zip(got, ref)):
        _agree(a, b, f"call {t}")


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_fused_exports_in_every_precision_pass_their_smoke_check(precision, exported):
    """The smoke check (ONNX Runtime vs PyTorch, prefill and decode) holds each to its precision's budgets; the
    fused node stays fp32 in fp16 (it reads the state: the accumulator region)."""
    feature_map, overrides = TINY["gated-deltanet"]
    _, folder = exported(feature_map, options={"ops": "fused", "check": True, "precision": precision}, **overrides)
    manifest = json.loads((folder / "edgelin.json").read_text())
    assert manifest["ops"] == "fused" and manifest["precision"] == precision
    assert _ops(folder)["decode"].get("LinearAttention") == 2


def test_the_api_refuses_an_unknown_lowering(tmp_path):
    from edgelin.errors import ExportError
    from edgelin.exporters import export

    with pytest.raises(ExportError, match="ops 'fast' is not a lowering; choose one of portable, fused"):
        export(tiny_model(), tmp_path / "x", ops="fast")
    assert not (tmp_path / "x").exists()


def test_a_runtime_without_the_node_says_what_to_do(bundled_fused, tmp_path):
    """An ONNX Runtime that lacks the node (older than 1.30; simulated by renaming the node's type in a copy) is
    refused in one line naming the node, the version to install and the portable lowering."""
    import shutil

    from edgelin.errors import EdgelinError
    from edgelin.runtime.providers import open_session

    _, fused_dir = bundled_fused
    shutil.copy(fused_dir / "weights.data", tmp_path / "weights.data")
    for missing in ("LinearAttention", "CausalConvWithState"):
        proto = onnx.load(str(fused_dir / "decode.onnx"), load_external_data=False)
        for node in proto.graph.node:
            if node.op_type == missing:
                node.op_type = f"{missing}V0"
        onnx.save(proto, str(tmp_path / "decode.onnx"))
        with pytest.raises(EdgelinError, match=rf"com\.microsoft\.{missing} node of a fused export: install onnxruntime >= 1\.30, or re-export with --ops portable") as err:
            open_session(tmp_path / "decode.onnx")
        assert "\n" not in str(err.value)
