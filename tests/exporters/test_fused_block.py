"""``edgelin export --ops fused`` around the mixers: the residual adds with their RMSNorms as
``SkipSimplifiedLayerNormalization`` nodes and a decode step's softmax attention as one ``GroupQueryAttention`` node, its
RoPE on q and k as one ``RotaryEmbedding`` node each.

Two tiny models on the skeleton (conv and attention layers, as LFM2 and Qwen3.5 stack them): plain RMSNorms with
per-head q/k norms and grouped heads in two attention layers (LFM2's), and unit-offset norms x / rms(x) * (1 + w) with a packed output
gate, partial rotary and a window (Qwen3.5's, with a window the mask rule's third clause). For each: the fused
export has the portable export's states and io, its graphs give the portable graphs' logits and states (a prefill of
two rows, then decode steps fed back, past the window), with one skip norm per residual add in both graphs and one
GroupQueryAttention node and two RotaryEmbedding nodes per attention layer in the decode graph (the prefill graph keeps
portable attention), the RoPE angles and the mask computed once per step for all attention layers; rows of different lengths (left-padded caches, ``Session.prefill_batch``: each row at its own
positions) decode together as in the portable graphs; and
eager PyTorch under the lowering equals the portable forms in float64; the JavaScript runtime runs the fused graphs in
node.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from edgelin import parity
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.norms import RMSNorm, UnitOffsetRMSNorm
from edgelin.layers.short_conv import GatedShortConv
from edgelin.ops import fused
from edgelin.runtime import load
from edgelin.skeleton import CausalLM

BUDGET = parity.held("fp32", {})[0]
D, VOCAB = 32, 97
ATTENTION = {  # model -> (attention options, norm class, layer kinds)
    "lfm2-like": (dict(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, rope_theta=1e6), RMSNorm, "caca"),
    "qwen-like": (dict(num_heads=4, num_kv_heads=1, head_dim=8, rotary_dim=4, qk_norm=True, unit_offset_norm=True,
                       output_gate=True, packed_gate=True, window=6), UnitOffsetRMSNorm, "ca"),
}


def tiny(name: str, seed: int = 0) -> CausalLM:
    options, norm, kinds = ATTENTION[name]
    torch.manual_seed(seed)

    def mixer(i: int):
        return Attention(AttentionOptions(d_model=D, **options)) if kinds[i] == "a" else GatedShortConv(D, 3)

    model = CausalLM(mixer, n_layers=len(kinds), vocab_size=VOCAB, d_model=D, mlp_hidden=48, norm_eps=1e-5, tie_embeddings=True,
                     chunk_size=16, config={"family": f"test/{name}", "chunk_size": 16}, norm=norm)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.normal_(1.0 if norm is RMSNorm else 0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def exports(export_of):
    """name -> (model, {lowering: export dir})."""
    out = {}
    for name in ATTENTION:
        model = tiny(name)
        out[name] = model, {ops: export_of(model, {"test_fused_block": name}, label=f"block-{name}", ops=ops, check=False)
                            for ops in fused.LOWERINGS}
    return out


def _ops(folder, graph: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(folder / f"{graph}.onnx"), load_external_data=False).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _drive(folder, prompt: np.ndarray, steps: np.ndarray):
    session = load(folder, provider="cpu")
    state = session.new_state(prompt.shape[0])
    logits = [session.prefill(prompt, state)]
    for t in range(steps.shape[1]):
        logits.append(session.decode(steps[:, t : t + 1], state))
    return logits, state.numpy()


@pytest.mark.parametrize("name", list(ATTENTION))
def test_fused_block_graphs_equal_the_portable_graphs(name, exports):
    model, folders = exports[name]
    manifests = {ops: json.loads((f / "edgelin.json").read_text()) for ops, f in folders.items()}
    for field in ("states", "io"):
        assert manifests["fused"][field] == manifests["portable"][field], field
    layers, attention = len(model.blocks), sum(isinstance(b.attn, Attention) for b in model.blocks)
    for graph in ("prefill", "decode"):
        fused_ops, portable_ops = _ops(folders["fused"], graph), _ops(folders["portable"], graph)
        assert fused_ops.get("SkipSimplifiedLayerNormalization") == 2 * layers, (graph, fused_ops)  # every residual add
        assert fused_ops.get("GroupQueryAttention", 0) == (attention if graph == "decode" else 0), (graph, fused_ops)
        assert fused_ops.get("RotaryEmbedding", 0) == (2 * attention if graph == "decode" else 0), (graph, fused_ops)  # q and k
        assert not {"SkipSimplifiedLayerNormalization", "GroupQueryAttention", "RotaryEmbedding"} & set(portable_ops), (graph, portable_ops)
    assert "Softmax" not in _ops(folders["fused"], "decode")
    for ops, folder in folders.items():  # the RoPE angles once per step, whatever the number of attention layers
        assert _ops(folder, "decode").get("Cos") == 1, ops
    biases = {n.input[10] for n in onnx.load(str(folders["fused"] / "decode.onnx"), load_external_data=False).graph.node
              if n.op_type == "GroupQueryAttention"}
    assert len(biases) == 1, biases  # one mask for the layers of one window

    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, VOCAB, (2, 21)), rng.integers(0, VOCAB, (2, 9))  # 30 positions: past the window of 6
    got, got_state = _drive(folders["fused"], prompt, steps)
    ref, ref_state = _drive(folders["portable"], prompt, steps)
    for t, (a, b) in enumerate(zip(got, ref)):
        errors = parity.errors(a, b)
        assert parity.within(errors, BUDGET["logits"]), f"{'prefill' if t == 0 else f'decode step {t}'}: {errors}"
    for key, value in ref_state.items():
        errors = parity.errors(got_state[key], value)
        assert parity.within(errors, BUDGET["state"]), f"state {key}: {errors}"


def test_rows_of_different_lengths_decode_together_as_in_the_portable_graphs(exports):
    """Left-padded caches (State.stack): the node reads the whole cache and the mask rule's bias hides the padding."""
    _, folders = exports["lfm2-like"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 11)]
    steps = rng.integers(0, VOCAB, (3, 6))
    out = {}
    for ops, folder in folders.items():
        session = load(folder, provider="cpu")
        logits, state = session.prefill_batch(prompts)
        out[ops] = [logits] + [session.decode(steps[:, t : t + 1], state) for t in range(steps.shape[1])]
    for t, (a, b) in enumerate(zip(out["fused"], out["portable"])):
        errors = parity.errors(a, b)
        assert parity.within(errors, BUDGET["logits"]), f"call {t}: {errors}"


@pytest.mark.parametrize("name", list(ATTENTION))
def test_eager_fused_forms_equal_the_portable_forms_in_float64(name):
    model = tiny(name).double()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        runs = {}
        for ops in fused.LOWERINGS:
            with fused.lowering(ops):
                logits, state = model(ids[:, :9])
                steps = []
                for t in range(9, 12):
                    step, state = model.step(ids[:, t : t + 1], state)
                    steps.append(step)
            runs[ops] = torch.cat([logits, *steps], dim=1), state
    assert (runs["fused"][0] - runs["portable"][0]).abs().max() < 1e-12
    for key, value in runs["portable"][1].items():
        assert (runs["fused"][1][key].double() - value.double()).abs().max() < 1e-12, key


def test_the_javascript_runtime_runs_the_fused_block_in_node(exports, tmp_path):
    """onnxruntime-node runs both contrib nodes: the export's golden prefill and decode outputs reproduced."""
    from testkit.node import javascript_check

    report = javascript_check(exports["lfm2-like"][1]["fused"], tmp_path)
    assert report["passed"], report
