"""edgelin's import of Hugging Face transformers Qwen3.5-MoE checkpoints against transformers' own model.

Oracle: hf_oracle.py (transformers 5.x's Qwen3_5MoeForCausalLM in a subprocess, fp32: its grouped matmul takes no
float64), with testkit/oracles/qwen3_5_moe_text.py's perturbation (Qwen3.5's, routers with clear margins). Tiny
hybrids of Gated DeltaNet and gated attention whose every MLP is a mixture of experts (softmax top-k, renormalised)
beside a gated shared expert; a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs
logits error <= 1e-4; the recurrent and conv states and the KV cache are compared too. The multimodal
``qwen3_5_moe`` folder imports as its text model.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.layers.moe import MoE
from testkit import hf_oracle
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.experts import fused_experts, moe_export_matches
from testkit.stateful import edited_copy, import_vs_reference, pieces_and_steps_agree, protocol_and_naive_agree

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
CASES = {
    # Gated DeltaNet, gated attention; 8 experts, top-2, a shared expert of another width; untied
    "qwen35moe-hybrid": {**TINY, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"], "num_experts": 8,
                         "num_experts_per_tok": 2},
    # the layer kinds from full_attention_interval (Gated DeltaNet, attention); 4 experts, every one chosen (k = E); tied
    "qwen35moe-all-experts-tied": {**TINY, "num_hidden_layers": 2, "full_attention_interval": 2, "num_experts": 4,
                                   "num_experts_per_tok": 4, "tie_word_embeddings": True},
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "qwen3_5_moe_text", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


def test_registry_lists_qwen3_5_moe():
    assert "qwen3_5_moe" in IMPORTERS and "qwen3_5_moe_text" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    for i, block in enumerate(model.blocks):
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:
            assert rel(state[f"{i}.S"], ref[f"{i}.recurrent"]) <= STATE_REL
        o = block.mlp.options
        assert isinstance(block.mlp, MoE) and block.mlp.shared_gate is not None and block.mlp.expert_bias is None
        assert (o.num_experts, o.top_k, o.scoring, o.renormalise, o.scaling) == (cfg["num_experts"], cfg["num_experts_per_tok"],
                                                                              "softmax", True, 1.0)


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("qwen35moe-hybrid", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/qwen3_5_moe_text", ids)
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


def test_the_vision_language_checkpoint_imports_as_its_text_model(tmp_path_factory, tmp_path):
    folder, prompt, *_ = oracle("qwen35moe-hybrid", tmp_path_factory)
    vl = hf_oracle.multimodal(folder, tmp_path / "vl")
    cfg = json.loads((vl / "config.json").read_text())
    cfg.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"])
    (vl / "config.json").write_text(json.dumps(cfg))
    model = load_checkpoint(vl)
    assert model.model_config()["family"] == "hf/qwen3_5_moe" and "vision tower" in model.model_config()["left_out"]
    with torch.no_grad():
        assert torch.equal(model(prompt[:, :20])[0], load_checkpoint(folder)(prompt[:, :20])[0])


@pytest.mark.slow  # one export of a 2-layer MoE hybrid with the delta rule's scan, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers (float64, its eager expert loop) and the
    routing agreement included; the JavaScript runtime in node."""
    folder, prompt, steps, ref = oracle("qwen35moe-hybrid", tmp_path_factory)
    out = tmp_path_factory.mktemp("qwen35moe-export") / "export"
    moe_export_matches(folder, prompt, steps, ref, out, tmp_path, MAX_ABS, moe_layers=2)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "at most num_experts (8)"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size", "positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"intermediate_size": 96}, "intermediate_size", "unknown"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen35moe-hybrid", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen35moe-hybrid", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", moe_intermediate_size=16), "model.layers.0.mlp.experts.0.down_proj.weight", "(64, 32)")


def test_experts_in_transformers_in_memory_layout_load_the_same(tmp_path_factory, tmp_path):
    """Experts stored fused, [E, 2I, D] and [E, D, I] (transformers' in-memory layout), import as the per-expert
    tensors save_pretrained writes: the same model."""
    folder, prompt, *_ = oracle("qwen35moe-hybrid", tmp_path_factory)
    fused = load_checkpoint(fused_experts(folder, tmp_path / "fused", "mlp", ("gate_proj", "up_proj"), "down_proj"))
    with torch.no_grad():
        assert torch.equal(fused(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])
