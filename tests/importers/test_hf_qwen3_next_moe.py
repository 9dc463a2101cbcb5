"""edgelin's import of Hugging Face transformers Qwen3-Next checkpoints with experts (every released Qwen3-Next is
sparse) against transformers' own model.

Oracle: hf_oracle.py (transformers 5.x's Qwen3NextForCausalLM in a subprocess, fp32: its grouped matmul takes no
float64), with testkit/oracles/qwen3_next.py's perturbation (routers and shared-expert gates with clear margins).
Tiny hybrids of Gated DeltaNet and gated attention whose MLPs are a mix of dense SwiGLUs and mixtures of experts
(softmax top-k, renormalised or not by ``norm_topk_prob``, a gated shared expert), the sparse layers chosen by
``mlp_only_layers`` in one case and by ``decoder_sparse_step`` in the other; a 150-token prefill then 20 cached
decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the recurrent and conv states and the KV cache are
compared too. The dense models' tests (the fused projections, the refusals of the shared fields) are in
test_hf_qwen3_next.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers.fields import Fields
from edgelin.importers.hf.qwen3_next import FIELDS, moe_layers
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.moe import MoE
from testkit import hf_oracle
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.experts import fused_experts, moe_export_matches
from testkit.stateful import edited_copy, import_vs_reference, pieces_and_steps_agree, protocol_and_naive_agree

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
CASES = {
    # Gated DeltaNet, attention, Gated DeltaNet; layers 0 and 1 sparse (layer 2 in mlp_only_layers: dense); 8 experts,
    # top-2, renormalised (norm_topk_prob's default, as released); untied
    "qwen3_next-moe-mlp-only": {**TINY, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [2],
                                "layer_types": ["linear_attention", "full_attention", "linear_attention"]},
    # attention, Gated DeltaNet, Gated DeltaNet; every second layer sparse (decoder_sparse_step 2: layer 1 only); 4
    # experts, top-3, the chosen scores kept as softmax probabilities (norm_topk_prob false); tied embeddings
    "qwen3_next-moe-step2-unnormed": {**TINY, "num_hidden_layers": 3, "num_experts": 4, "num_experts_per_tok": 3,
                                      "layer_types": ["full_attention", "linear_attention", "linear_attention"],
                                      "decoder_sparse_step": 2, "norm_topk_prob": False, "tie_word_embeddings": True},
}
# tokens per prefill call of the export: the delta rule's scan gets 2 levels at C = 64 (a faster trace), above the
# longest call its test makes (validate's routing check: 200 tokens in one call; longer prompts go in pieces)
SCAN_BOUND = 256
SPARSE = {"qwen3_next-moe-mlp-only": [0, 1], "qwen3_next-moe-step2-unnormed": [1]}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "qwen3_next", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


@pytest.mark.parametrize("changes, sparse", [
    ({}, [0, 1, 2, 3, 4, 5]),  # every layer (num_experts 512, decoder_sparse_step 1: the released configs)
    ({"decoder_sparse_step": 2}, [1, 3, 5]),
    ({"decoder_sparse_step": 3, "mlp_only_layers": [2, 4]}, [5]),
    ({"mlp_only_layers": [0, 5, 9]}, [1, 2, 3, 4]),  # an index past the stack changes nothing
    ({"num_experts": 0}, []),
])
def test_sparse_layers_follow_transformers_rule(changes, sparse):
    """Qwen3NextDecoderLayer: experts where num_experts > 0, i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    assert moe_layers(Fields(changes, FIELDS, Path("config.json")), 6) == sparse


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    assert model.model_config()["family"] == "hf/qwen3_next"
    cfg = CASES[case_id]
    for i, block in enumerate(model.blocks):
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL
            assert rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:
            assert rel(state[f"{i}.S"], ref[f"{i}.recurrent"]) <= STATE_REL
            assert rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
        if i not in SPARSE[case_id]:
            assert type(block.mlp) is SwiGLU and block.mlp.gate.weight.shape[0] == cfg["intermediate_size"]
            continue
        o = block.mlp.options
        assert isinstance(block.mlp, MoE) and block.mlp.shared_gate is not None and block.mlp.expert_bias is None
        assert (o.num_experts, o.top_k, o.scoring, o.renormalise, o.scaling, o.expert_hidden, o.shared_hidden) == (
            cfg["num_experts"], cfg["num_experts_per_tok"], "softmax", cfg.get("norm_topk_prob", True), 1.0, 32, 48)


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("qwen3_next-moe-step2-unnormed", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/qwen3_next", ids)
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # one export of a 3-layer hybrid with two MoE layers, validate against transformers, node
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers (float64, its eager expert loop) and the
    routing agreement included; the JavaScript runtime in node."""
    folder, prompt, steps, ref = oracle("qwen3_next-moe-mlp-only", tmp_path_factory)
    out = tmp_path_factory.mktemp("qwen3_next-moe-export") / "export"
    moe_export_matches(folder, prompt, steps, ref, out, tmp_path, MAX_ABS, moe_layers=2, max_sequence=SCAN_BOUND)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "at most num_experts (8)"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size", "positive integer"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size", "positive integer"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob", "true or false"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_next-moe-mlp-only", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_next-moe-mlp-only", tmp_path_factory)
    # layer 2 made sparse too: its dense MLP's tensors are not the experts the config now says
    refused(edited_copy(folder, tmp_path / "ckpt", mlp_only_layers=[]), "model.layers.2.mlp")


def test_experts_in_transformers_in_memory_layout_load_the_same(tmp_path_factory, tmp_path):
    """Experts stored stacked, [E, 2I, D] and [E, D, I] (transformers' in-memory layout), import as the per-expert
    tensors save_pretrained writes: the same model, the dense layer beside them untouched."""
    folder, prompt, *_ = oracle("qwen3_next-moe-mlp-only", tmp_path_factory)
    fused = load_checkpoint(fused_experts(folder, tmp_path / "fused", "mlp", ("gate_proj", "up_proj"), "down_proj"))
    with torch.no_grad():
        assert torch.equal(fused(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])
