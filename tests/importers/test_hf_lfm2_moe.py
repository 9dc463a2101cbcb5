"""edgelin's import of Hugging Face transformers LFM2-MoE checkpoints against transformers' own model.

Oracle: hf_oracle.py (transformers 5.x's Lfm2MoeForCausalLM in a subprocess, fp32: its grouped matmul takes no
float64), with testkit/oracles/lfm2_moe.py's perturbation: routers with clear margins and a non-zero expert_bias.
Tiny hybrids of gated short convs and attention, dense MLPs before ``num_dense_layers`` and mixture-of-experts MLPs
after; a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the
cache (conv windows, keys, values) is compared too.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
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
TINY = {"vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "moe_intermediate_size": 32}
CASES = {
    # conv, attention, conv; one dense layer, then 8 experts top-2 chosen with expert_bias, renormalised; tied
    "lfm2moe-dense1-bias": {**TINY, "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
                            "num_dense_layers": 1, "num_experts": 8, "num_experts_per_tok": 2},
    # attention, conv; no dense layer; 4 experts top-3 without bias or renormalisation, scaled by 2.5; untied, conv
    # biases, 4 taps, another rope_theta
    "lfm2moe-nobias-scaled": {
        **TINY, "num_hidden_layers": 2, "layer_types": ["full_attention", "conv"], "num_dense_layers": 0, "num_experts": 4,
        "num_experts_per_tok": 3, "use_expert_bias": False, "norm_topk_prob": False, "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False, "conv_bias": True, "conv_L_cache": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "lfm2_moe", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


def test_registry_lists_lfm2_moe():
    assert "lfm2_moe" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    for i, block in enumerate(model.blocks):
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:  # the last L_cache values of B * x, [B, hidden, L_cache]
            assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
        dense = i < cfg["num_dense_layers"]
        assert type(block.mlp) is (SwiGLU if dense else MoE)
        if not dense:
            o = block.mlp.options
            assert (o.num_experts, o.top_k, o.scoring, o.renormalise) == (cfg["num_experts"], cfg["num_experts_per_tok"], "sigmoid",
                                                                       cfg.get("norm_topk_prob", True))
            assert o.scaling == cfg.get("routed_scaling_factor", 1.0)
            assert (block.mlp.expert_bias is not None) == cfg.get("use_expert_bias", True)
            if block.mlp.expert_bias is not None:
                assert block.mlp.expert_bias.abs().max() > 0.1  # the perturbed bias was read
    assert model.max_positions == 128000


def test_routing_margins_are_clear(tmp_path_factory):
    """The oracle's routers leave no near tie at the top-k boundary (a flip within float32 rounding would make the
    comparisons above depend on luck): the k-th and (k+1)-th choice scores differ by more than 1e-4 everywhere."""
    folder, prompt, *_ = oracle("lfm2moe-dense1-bias", tmp_path_factory)
    model = load_checkpoint(folder)
    gaps = []
    hooks = []
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            def gap(mod, args):
                scores = torch.sigmoid(mod.router(args[0])).reshape(-1, mod.options.num_experts) + mod.expert_bias
                top = scores.topk(mod.options.top_k + 1, dim=-1).values
                gaps.append((top[:, -2] - top[:, -1]).min())
            hooks.append(block.mlp.register_forward_pre_hook(gap))
    with torch.no_grad():
        model(prompt)
    assert len(gaps) == 2 and min(gaps) > 1e-4, gaps


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("lfm2moe-nobias-scaled", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/lfm2_moe", ids)
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # an export of a 3-layer MoE hybrid, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers (float64, its eager expert loop) and the
    routing agreement included; the JavaScript runtime in node. Each expert's MatMuls run on the rows routed to it
    only: one NonZero and one ScatterND per expert per MoE layer in both graphs."""
    folder, prompt, steps, ref = oracle("lfm2moe-dense1-bias", tmp_path_factory)
    out = tmp_path_factory.mktemp("lfm2-moe-export") / "export"
    moe_export_matches(folder, prompt, steps, ref, out, tmp_path, MAX_ABS, moe_layers=2,
                       experts=CASES["lfm2moe-dense1-bias"]["num_experts"])


@pytest.mark.parametrize("changes, field, fragment", [
    ({"layer_types": None}, "layer_types", "'conv' or 'full_attention'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "at most num_experts (8)"),
    ({"num_dense_layers": -1}, "num_dense_layers", "non-negative integer"),
    ({"routed_scaling_factor": "2"}, "routed_scaling_factor", "must be a number"),
    ({"use_expert_bias": "yes"}, "use_expert_bias", "true or false"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters", "'default'"),
    ({"full_attn_idxs": [1]}, "full_attn_idxs", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm2moe-dense1-bias", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm2moe-dense1-bias", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", moe_intermediate_size=16), "model.layers.1.feed_forward.experts.0.w1.weight", "(32, 64)")
    # layer 1 said dense: its experts and router are tensors the config does not describe
    refused(edited_copy(folder, tmp_path / "ckpt2", num_dense_layers=2), "model.layers.1.feed_forward.expert", "does not describe")


def test_experts_in_transformers_in_memory_layout_load_the_same(tmp_path_factory, tmp_path):
    """Experts stored fused, [E, 2I, D] and [E, D, I] (transformers' in-memory layout), import as the per-expert
    tensors save_pretrained writes: the same model."""
    folder, prompt, *_ = oracle("lfm2moe-dense1-bias", tmp_path_factory)
    fused = load_checkpoint(fused_experts(folder, tmp_path / "fused", "feed_forward", ("w1", "w3"), "w2"))
    with torch.no_grad():
        assert torch.equal(fused(prompt[:, :30])[0], load_checkpoint(folder)(prompt[:, :30])[0])
