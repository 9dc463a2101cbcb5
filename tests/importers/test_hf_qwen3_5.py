"""edgelin's import of Hugging Face transformers Qwen3.5 checkpoints against transformers' own model.

The oracle is transformers 5.x's Qwen3_5ForCausalLM with its whole forward (its PyTorch gated delta rule and
causal conv, its gated attention with partial RoPE and zero-centred norms, its DynamicCache), run in a subprocess
(tests/testkit/hf_oracle.py) that hides fla so transformers takes its PyTorch paths. A tiny random hybrid (Gated DeltaNet
layers with grouped value heads and full-attention layers, 3:1), a 150-token prefill then 20 cached decode steps,
batch 2. Budget, fp32: max abs logits error <= 1e-4; the cache (recurrent states, conv windows, keys, values) is
compared too. The multimodal ``qwen3_5`` folder imports as its text model.
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
MAX_SEQUENCE = 1024  # tokens per prefill call: the delta rule's scan gets 4 levels at C = 64 (a faster export than at 4,096)
TINY = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
CASES = {
    # transformers' defaults for everything else: 3 Gated DeltaNet layers then one attention layer, conv 4,
    # partial_rotary_factor 0.25 (RoPE on 4 of 16 features), rope_theta 10000, untied
    "qwen3_5-hybrid4": {**TINY, "num_hidden_layers": 4},
    # attention first, explicit layer_types, tied embeddings, half-width RoPE at theta 1e6, conv 3, 4 KV heads
    "qwen3_5-types-tied-rope-conv3": {
        **TINY, "num_hidden_layers": 3, "layer_types": ["full_attention", "linear_attention", "linear_attention"],
        "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        "linear_conv_kernel_dim": 3, "num_key_value_heads": 4, "linear_num_value_heads": 2,
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "qwen3_5_text", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=TINY["vocab_size"])



def test_registry_lists_qwen3_5():
    assert {"qwen3_5_text", "qwen3_5"} <= set(IMPORTERS)


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    kinds = {"fla/delta": 0, "attention": 0}
    for i, block in enumerate(model.blocks):
        kinds[block.attn.kind] += 1
        if block.attn.kind == "attention":  # transformers' cache: [B, Hkv, P, D], keys after the norm and RoPE
            assert state[f"{i}.key"].shape == ref[f"{i}.key"].shape
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
            assert state[f"{i}.pos"].tolist() == [PROMPT + STEPS] * BATCH
        else:  # recurrent state [B, Nv, K, V] (the same layout); the conv window [B, 2 key + value, W]
            assert state[f"{i}.S"].shape == ref[f"{i}.recurrent"].shape and rel(state[f"{i}.S"], ref[f"{i}.recurrent"]) <= STATE_REL
            assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
    assert kinds["attention"] >= 1 and kinds["fla/delta"] >= 2
    assert model.max_positions == 32768  # transformers' default max_position_embeddings: the declared context


def test_protocol_and_forms_agree_in_float64(tmp_path_factory):
    """The protocol; the naive forms (the delta rule's loop, attention per query) against the chunk form in
    float64; prefill in pieces and token by token against one prefill."""
    folder, *_ = oracle("qwen3_5-hybrid4", tmp_path_factory)
    model = load_checkpoint(folder)
    ids = torch.randint(0, 97, (2, 2 * model.chunk_size + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/qwen3_5_text", ids)
    pieces_and_steps_agree(model, ids, (1, 63, 65))


def test_the_multimodal_checkpoint_imports_as_its_text_model(tmp_path_factory, tmp_path):
    folder, prompt, steps, ref = oracle("qwen3_5-hybrid4", tmp_path_factory)
    model = load_checkpoint(hf_oracle.multimodal(folder, tmp_path / "vl"))
    assert model.model_config()["family"] == "hf/qwen3_5" and "vision tower" in model.model_config()["left_out"]
    text = load_checkpoint(folder)
    with torch.no_grad():
        assert torch.equal(model(prompt[:, :20])[0], text(prompt[:, :20])[0])


@pytest.mark.slow  # one export of a 4-layer hybrid with the delta rule's scan: ~2 min on a loaded 2-core machine
def test_export_matches_transformers(tmp_path_factory):
    """Both ONNX graphs in ONNX Runtime, driven from the manifest alone, against transformers' logits; validate
    against the checkpoint passes."""
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("qwen3_5-hybrid4", tmp_path_factory)
    out = tmp_path_factory.mktemp("qwen3_5-export") / "export"
    export(folder, out, check=False, max_sequence=MAX_SEQUENCE)
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()



def test_fused_export_matches_transformers(tmp_path_factory):
    """``--ops fused``: the Gated DeltaNet layers' recurrence as ONNX Runtime's LinearAttention node (one per such layer, in
    both graphs); both graphs against transformers' logits within the same budget as the portable export."""
    folder, prompt, steps, ref = oracle("qwen3_5-hybrid4", tmp_path_factory)
    out = tmp_path_factory.mktemp("qwen3_5-hybrid4-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")

@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts": 8}, "num_experts", "mixture-of-experts"),
    ({"attention_bias": True}, "attention_bias", "false only"),
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters", "unknown"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters", "'default'"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types", "4 entries"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads", "multiple of linear_num_key_heads (2)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"sliding_window": 16}, "sliding_window", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_5-hybrid4", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_released_config_fields_are_accepted(tmp_path_factory, tmp_path):
    """Fields of Qwen3.5's released configs that transformers' model does not read (the gate flag, the SSM dtype,
    the multi-token-prediction head's) and the multimodal RoPE keys import to the same model."""
    folder, prompt, _, ref = oracle("qwen3_5-hybrid4", tmp_path_factory)
    rope = {"type": "default", "mrope_section": [1, 1, 0], "mrope_interleaved": True, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    out = edited_copy(folder, tmp_path / "ckpt", attn_output_gate=True, mamba_ssm_dtype="float32", mtp_num_hidden_layers=1,
                      mtp_use_dedicated_embeddings=False, rope_parameters=rope)
    with torch.no_grad():
        assert max_abs(load_checkpoint(out)(prompt)[0], ref["prefill"]) <= MAX_ABS


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_5-hybrid4", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", linear_conv_kernel_dim=3), "model.layers.0.linear_attn.conv1d.weight", "(96, 1, 4)")
