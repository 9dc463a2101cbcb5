"""edgelin's import of Hugging Face transformers LFM2 checkpoints against transformers' own model.

Same oracle as test_hf_qwen3_5.py (hf_oracle.py: transformers 5.x's Lfm2ForCausalLM, its PyTorch causal conv and
DynamicCache, in a subprocess): a tiny random hybrid of gated short-conv and attention layers, a 150-token prefill
then 20 cached decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the cache (conv windows, keys,
values) is compared too.
"""

from __future__ import annotations

import json
import shutil

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
TINY = {"vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "block_multiple_of": 32}
CASES = {
    # conv, attention, conv, attention; tied embeddings, conv of 3 taps, MLP width int(2 * 192 / 3) rounded to 32
    "lfm2-hybrid4": {**TINY, "intermediate_size": 192, "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # attention layers from full_attn_idxs, conv biases, 4 taps, untied, another rope_theta, no MLP width adjustment
    "lfm2-idxs-bias-conv4-untied": {
        **TINY, "intermediate_size": 80, "num_hidden_layers": 3, "full_attn_idxs": [1], "conv_bias": True, "conv_L_cache": 4,
        "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}, "block_auto_adjust_ff_dim": False,
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "lfm2", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=TINY["vocab_size"])



def test_registry_lists_lfm2():
    assert "lfm2" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    kinds = set()
    for i, block in enumerate(model.blocks):
        kinds.add(block.attn.kind)
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:  # the last L_cache values of B * x, [B, hidden, L_cache]
            assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
    assert kinds == {"attention", "short_conv"}
    assert model.max_positions == 128000


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the short conv's naive loop and attention's naive form against the chunk form in float64;
    prefill in pieces of 1 (shorter than the conv window), 2 and 40 from a carried state against one prefill."""
    folder, *_ = oracle("lfm2-idxs-bias-conv4-untied", tmp_path_factory)
    model = load_checkpoint(folder)
    ids = torch.randint(0, 97, (2, 43), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/lfm2", ids)
    assert model.state_decays
    pieces_and_steps_agree(model, ids, (1, 2, 40))


@pytest.mark.slow  # one export of a 4-layer hybrid: ~1 min on a loaded 2-core machine
def test_export_matches_transformers(tmp_path_factory):
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("lfm2-hybrid4", tmp_path_factory)
    out = tmp_path_factory.mktemp("lfm2-export") / "export"
    summary = export(folder, out, check=False).summary()
    assert "per position of context" in summary and "constant in sequence length" not in summary, summary
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()


def test_fused_export_matches_transformers(tmp_path_factory):
    """``--ops fused``: each gated short conv's window as ONNX Runtime's CausalConvWithState node (one per conv layer,
    in both graphs; no LinearAttention: LFM2 has no recurrence); both graphs against transformers' logits within
    the portable export's budget."""
    folder, prompt, steps, ref = oracle("lfm2-hybrid4", tmp_path_factory)
    out = tmp_path_factory.mktemp("lfm2-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts": 8}, "num_experts", "mixture-of-experts"),
    ({"layer_types": ["conv", "attention", "conv", "conv"]}, "layer_types", "'conv' or 'full_attention'"),
    ({"layer_types": None, "full_attn_idxs": [7]}, "full_attn_idxs", "0..3"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope_parameters", "'default'"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"conv_bias": "no"}, "conv_bias", "true or false"),
    ({"use_moe": True}, "use_moe", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm2-hybrid4", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_released_config_fields_transformers_does_not_read_are_accepted(tmp_path_factory, tmp_path):
    """LFM2's released configs carry fields transformers' model never reads (block_dim, conv_dim, theta, ...):
    they change nothing there, so they change nothing here; the older names it does read are honoured."""
    folder, prompt, _, ref = oracle("lfm2-hybrid4", tmp_path_factory)
    cfg = json.loads((folder / "config.json").read_text())
    legacy = {"block_dim": 64, "conv_dim": 64, "conv_dim_out": 64, "block_norm_eps": 1e-5, "theta": 1e6, "use_pos_enc": True,
              "block_ff_dim": cfg.pop("intermediate_size"), "tie_embedding": cfg.pop("tie_word_embeddings")}
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**cfg, **legacy}))
    shutil.copy(folder / "model.safetensors", out / "model.safetensors")
    with torch.no_grad():
        assert max_abs(load_checkpoint(out)(prompt)[0], ref["prefill"]) <= MAX_ABS


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm2-hybrid4", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", conv_L_cache=4), "model.layers.0.conv.conv.weight", "(64, 1, 3)")
