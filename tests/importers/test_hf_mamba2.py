"""edgelin's import of Hugging Face transformers Mamba2, Bamba, Granite-4.0-H (dense) and Nemotron-H (dense) checkpoints
against transformers' own model.

Same oracle as test_hf_qwen3_5.py (testkit/hf_oracle.py: transformers 5.x's Mamba2ForCausalLM on its PyTorch path,
in a subprocess): a tiny random model, a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32:
max abs logits error <= 1e-4; the cache (SSM states, conv windows) is compared too. The SSD recurrence runs on the
linear-attention chunk form with a per-head decay (edgelin.layers.mamba2); Bamba puts it among attention layers (partial
RoPE) with an MLP in every block; Granite-4.0-H adds its multipliers and attention without position encoding;
Nemotron-H makes each layer one of Mamba2, attention (no position encoding) or a stateless relu^2 MLP.
"""

from __future__ import annotations


import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from testkit import max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit import hf_oracle
from testkit.stateful import edited_copy, export_vs_reference, fused_export_vs_reference, import_vs_reference, pieces_and_steps_agree, protocol_and_naive_agree

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2}
GRANITE = {
    "vocab_size": 97, "hidden_size": 32, "shared_intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 0, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8,
    "mamba_d_conv": 4, "mamba_expand": 2,
}
CASES = {  # id -> (model_type, config)
    "mamba2-groups2": ("mamba2", {**TINY, "num_heads": 8, "head_dim": 8, "n_groups": 2, "conv_kernel": 4}),
    # one group, biases on the projections but not the conv, a conv of 3 taps, tied embeddings, wider heads
    "mamba2-group1-bias-conv3-tied": ("mamba2", {
        **TINY, "num_heads": 4, "head_dim": 16, "n_groups": 1, "conv_kernel": 3, "use_bias": True, "use_conv_bias": False,
        "tie_word_embeddings": True,
    }),
    # Mamba2, attention (4 heads, 2 KV heads, RoPE on half of each head), Mamba2; an MLP in every block
    "bamba-attn1-groups2": ("bamba", {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_expand": 2,
    }),
    # Granite-4.0-H (dense): every multiplier away from 1, RoPE on; then no position encoding, tied, attention first
    "granite-rope-multipliers": ("granitemoehybrid", {**GRANITE, "layer_types": ["mamba", "attention", "mamba"],
                                                      "position_embedding_type": "rope", "embedding_multiplier": 3.0,
                                                      "residual_multiplier": 0.5, "logits_scaling": 1.25, "attention_multiplier": 0.2}),
    "granite-nope-tied": ("granitemoehybrid", {**GRANITE, "layer_types": ["attention", "mamba", "mamba"], "tie_word_embeddings": True}),
    # Nemotron-H (dense): Mamba2 (8 heads of 6, 2 groups, conv 3), MLP, attention (4 heads, 2 KV heads of 8), Mamba2,
    # MLP; head dims that are not hidden / heads. time_step_min (its mixers' lower clamp of dt, and the low end of
    # dt's init) below every dt: transformers clamps in its prefill only (see test_a_time_step_limit_...)
    "nemotron-pattern": ("nemotron_h", NEMOTRON := {
        "vocab_size": 97, "hidden_size": 32, "hybrid_override_pattern": "M-*M-", "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 40, "mamba_num_heads": 8, "mamba_head_dim": 6,
        "ssm_state_size": 8, "n_groups": 2, "conv_kernel": 3, "time_step_min": 1e-5,
    }),
    # the clamp at work: dt drawn in [0.05, 0.06] and perturbed (about half below 0.05), clamped below at 0.05
    "nemotron-dt-floor": ("nemotron_h", {**NEMOTRON, "time_step_min": 0.05, "time_step_max": 0.06}),
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    model_type, config = CASES[case_id]
    return hf_oracle.cached(_RESULTS, case_id, model_type, config, tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=TINY["vocab_size"])



def test_registry_lists_mamba2_and_its_hybrids():
    assert {"mamba2", "bamba", "granitemoehybrid", "nemotron_h"} <= set(IMPORTERS)


@pytest.mark.parametrize("case_id", [case for case in CASES if case != "nemotron-dt-floor"])  # (that one: below)
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    family = CASES[case_id][0]
    hybrid = family != "mamba2"
    for i, block in enumerate(model.blocks):
        assert (block.mlp is None) is (family in ("mamba2", "nemotron_h"))  # Mamba2's and Nemotron-H's blocks hold one mixer
        if block.attn.kind == "mlp":  # Nemotron-H's "-" layers: no state, no cache in transformers either
            assert family == "nemotron_h" and not any(key.startswith(f"{i}.") for key in state) and f"{i}.key" not in ref
            continue
        if block.attn.kind == "attention":
            assert hybrid and rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
            continue
        assert block.attn.kind == "mamba2"
        S = ref[f"{i}.recurrent"].transpose(-1, -2)  # transformers: [B, H, P, N]; edgelin: [B, H, N, P]
        assert state[f"{i}.S"].shape == S.shape and rel(state[f"{i}.S"], S) <= STATE_REL
        assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
    # no attention: no context limit (Bamba's: its max_position_embeddings); the states decay or are caches
    limits = {"mamba2": None, "bamba": 262144, "granitemoehybrid": 2048, "nemotron_h": 4096}  # transformers' defaults
    assert model.max_positions == limits[family] and model.state_decays


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the ops' naive form against the chunk form in float64; prefill in pieces (1 token: shorter
    than the conv window; C - 1; C + 1) and token by token against one prefill."""
    folder, *_ = oracle("mamba2-groups2", tmp_path_factory)
    model = load_checkpoint(folder)
    ids = torch.randint(0, 97, (2, 129), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/mamba2", ids)
    pieces_and_steps_agree(model, ids, (1, 63, 65))


def test_a_time_step_limit_is_applied_in_every_form(tmp_path_factory, tmp_path):
    """transformers clamps dt by time_step_limit when it prefills but not in its one-token step; edgelin clamps in
    both, so the prefill and the decode of a model with a finite limit agree, and the limit changes the model."""
    folder, prompt, *_ = oracle("mamba2-groups2", tmp_path_factory)
    limited = load_checkpoint(edited_copy(folder, tmp_path / "ckpt", time_step_limit=[0.0, 0.05]))
    with torch.no_grad():
        assert max_abs(limited(prompt[:, :40])[0], load_checkpoint(folder)(prompt[:, :40])[0]) > 1e-2
    pieces_and_steps_agree(limited, prompt[:, :40], (20, 20))


@pytest.mark.slow  # one export each: ~1 min on a loaded 2-core machine
@pytest.mark.parametrize("case_id", ["mamba2-groups2", "granite-rope-multipliers", "nemotron-pattern"])
def test_export_matches_transformers(case_id, tmp_path_factory):
    """Both ONNX graphs against transformers: Mamba2 (a fixed-size state), Granite-4.0-H (Mamba2 and attention
    layers, every multiplier away from 1, a growing state) and Nemotron-H (layers without state among them)."""
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"{case_id}-export") / "export"
    summary = export(folder, out, check=False).summary()
    assert ("constant in sequence length" in summary) is (case_id == "mamba2-groups2"), summary
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()



def test_fused_export_matches_transformers(tmp_path_factory):
    """``--ops fused``: the Mamba2 layers' recurrence as ONNX Runtime's LinearAttention node (one per such layer, in
    both graphs); both graphs against transformers' logits within the same budget as the portable export."""
    folder, prompt, steps, ref = oracle("mamba2-groups2", tmp_path_factory)
    out = tmp_path_factory.mktemp("mamba2-groups2-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")

@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_heads": 6}, "num_heads", "must equal hidden_size x expand"),
    ({"n_groups": 3}, "n_groups", "must divide num_heads (8)"),
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"norm_before_gate": True}, "norm_before_gate", "gates before the norm"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit", "0 <= low <= high"),
    ({"d_mlp": 64}, "d_mlp", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("mamba2-groups2", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"attention_bias": True}, "attention_bias", "false only"),
    ({"mamba_d_head": 5}, "mamba_d_head", "must equal mamba_expand x hidden_size"),
    ({"mamba_n_groups": 3}, "mamba_n_groups", "must divide mamba_n_heads (8)"),
    ({"attn_layer_indices": [5]}, "attn_layer_indices", "0..2"),
    ({"num_experts": 4}, "num_experts", "unknown"),
])
def test_unsupported_bamba_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("bamba-attn1-groups2", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_local_experts": -1}, "num_local_experts", "must be 0 (dense MLPs) or a positive number of experts"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type", "'rope'"),
    ({"layer_types": ["mamba", "mlp", "mamba"]}, "layer_types", "'mamba' or 'attention'"),
    ({"attention_multiplier": 0}, "attention_multiplier", "positive"),
])
def test_unsupported_granite_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("granite-nope-tied", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"layers_block_type": None, "hybrid_override_pattern": "M-E*-", "n_group": 3}, "n_group", "must divide n_routed_experts (8)"),
    ({"layers_block_type": ["linear_attention", "moe"], "topk_group": 2}, "topk_group", "at most n_group (1)"),
    ({"layers_block_type": None, "hybrid_override_pattern": "M-X"}, "hybrid_override_pattern", "a string of M, *, -, E"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act", "'relu2'"),
    ({"sliding_window": 16}, "sliding_window", "supports null"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers", "multi-token-prediction"),
    ({"mamba_n_groups": 3}, "mamba_n_groups", "must divide mamba_num_heads (8)"),
    ({"num_hidden_layers": 4}, "num_hidden_layers", "lists 5 layers"),
    ({"attention_bias": True}, "attention_bias", "false only"),
])
def test_unsupported_nemotron_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("nemotron-pattern", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_nemotron_clamps_dt_below_at_time_step_min(tmp_path_factory, tmp_path):
    """Nemotron-H's mixer clamps dt below at ``time_step_min`` (not ``time_step_limit``, which it never reads): with
    the clamp at work (dt drawn around 0.05, clamped below at 0.05) the prefill matches transformers', and the same
    weights without the clamp (time_step_min 0) do not. (transformers' one-token step does not clamp: the decode is
    not compared here.)"""
    folder, prompt, _, ref = oracle("nemotron-dt-floor", tmp_path_factory)
    with torch.no_grad():
        clamped = max_abs(load_checkpoint(folder)(prompt)[0], ref["prefill"])
        unclamped = max_abs(load_checkpoint(edited_copy(folder, tmp_path / "ckpt", time_step_min=0.0))(prompt)[0], ref["prefill"])
    assert clamped <= MAX_ABS and unclamped > max(MAX_ABS, 10 * clamped), (clamped, unclamped)


def test_a_released_configs_pattern_string_builds_the_same_model(tmp_path_factory, tmp_path):
    """Released Nemotron-H configs give the layers as ``hybrid_override_pattern`` ("M-*M-") and ``num_hidden_layers``;
    transformers saves ``layers_block_type``: both give the same model."""
    folder, prompt, _, ref = oracle("nemotron-pattern", tmp_path_factory)
    released = load_checkpoint(edited_copy(folder, tmp_path / "ckpt", layers_block_type=None, hybrid_override_pattern="M-*M-",
                                           num_hidden_layers=5))
    assert [b.attn.kind for b in released.blocks] == ["mamba2", "mlp", "attention", "mamba2", "mlp"]
    with torch.no_grad():
        assert max_abs(released(prompt)[0], ref["prefill"]) <= MAX_ABS


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("mamba2-groups2", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", conv_kernel=3), "backbone.layers.0.mixer.conv1d.weight", "(96, 1, 4)")
