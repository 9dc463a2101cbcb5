"""edgelin's import of Hugging Face transformers LFM3 checkpoints against transformers' own model.

Same oracle as test_hf_lfm2.py (hf_oracle.py: transformers 5.x's Lfm3ForCausalLM, its PyTorch causal conv and
DynamicCache with sliding-window layers, in a subprocess): tiny random hybrids of gated short convs (7 taps and 4),
sliding-window attention with windows shorter than the prompt and full attention with proportional RoPE; sandwich
norms and the per-head output gate on and off. A 150-token prefill then 20 cached decode steps, batch 2. Budget,
fp32: max abs logits error <= 1e-4; the cache (conv windows, keys, values) is compared too.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgelin import parity, upstream
from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.importers.fields import check_fields
from edgelin.importers.hf.lfm3 import FIELDS, read_layer_types
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2

from testkit import hf_oracle
from testkit.node import javascript_check
from testkit.stateful import (
    edited_copy, export_vs_reference, import_vs_reference, pieces_and_steps_agree,
    protocol_and_naive_agree,
)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 16,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
CASES = {
    # conv (7 taps), sliding (window 40), full (proportional RoPE over a quarter of the pairs); sandwich norms, the
    # per-head gate, 2 KV heads, tied embeddings, transformers' default rope_parameters
    "lfm3-sandwich-gate": {**TINY, "num_key_value_heads": 2, "num_hidden_layers": 3, "sliding_window": 40,
                           "layer_types": ["conv", "sliding_attention", "full_attention"]},
    # sliding (window 24) first, conv (4 taps, biases), full; no sandwich norms, no gate, q/k/v/o biases, 1 KV head,
    # untied, other RoPE (default on the sliding layers, proportional over 1/4 of the head on the full ones)
    "lfm3-plain-bias-conv4": {
        **TINY, "num_key_value_heads": 1, "num_hidden_layers": 3, "sliding_window": 24, "conv_L_cache": 4, "conv_bias": True,
        "layer_types": ["sliding_attention", "conv", "full_attention"], "use_sandwich_norm": False, "use_attention_gate": False,
        "attention_bias": True, "tie_word_embeddings": False,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
                            "full_attention": {"rope_type": "proportional", "rope_theta": 2e5, "partial_rotary_factor": 0.25}},
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "lfm3", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=TINY["vocab_size"])


def test_registry_lists_lfm3():
    assert "lfm3" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    sandwich = cfg.get("use_sandwich_norm", True)
    for i, (block, kind) in enumerate(zip(model.blocks, cfg["layer_types"])):
        assert block.placement == ("sandwich" if sandwich else "pre")
        if kind == "conv":  # the last L_cache values of B * x, [B, hidden, L_cache]
            assert block.attn.kind == "short_conv"
            assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
            continue
        assert block.attn.kind == "attention" and (block.attn.g_proj is not None) == cfg.get("use_attention_gate", True)
        key, value = state[f"{i}.key"], state[f"{i}.value"]
        if kind == "sliding_attention":  # edgelin keeps the last W positions, transformers the last W - 1
            window = cfg["sliding_window"]
            assert block.attn.o.window == window and key.shape[2] == window < PROMPT + STEPS
            key, value = key[:, :, 1:], value[:, :, 1:]
        assert key.shape == ref[f"{i}.key"].shape
        assert rel(key, ref[f"{i}.key"]) <= STATE_REL and rel(value, ref[f"{i}.value"]) <= STATE_REL
    assert model.max_positions == 128000


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms against the chunk form in float64; prefill in pieces of 1, chunk - 1 and
    chunk + 1 (past the 24-token window) from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("lfm3-plain-bias-conv4", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/lfm3", ids)
    assert model.state_decays
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # an export of a 3-layer hybrid, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate (300 tokens: past the 40-token window) passes, transformers
    included; the JavaScript runtime in node; and a checkpoint whose sliding_window differs by one from what the import read departs at the sliding layer."""
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("lfm3-sandwich-gate", tmp_path_factory)
    out = tmp_path_factory.mktemp("lfm3-export") / "export"
    summary = export(folder, out, check=False).summary()
    assert "per position of context" in summary, summary
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()
    # the JavaScript runtime in node: a windowed KV cache (its own past dim) beside a full one, both graphs vs golden
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report

    # transformers run on a window one longer than the import's: the import departs at layer 1, the sliding one
    fp32 = parity.BUDGETS["fp32"]["upstream"]
    wider = edited_copy(folder, tmp_path / "wider", sliding_window=41)
    ids, more = prompt[:, :69].numpy(), steps[:, :4].numpy()
    got, model = upstream.run(wider, "transformers", ids, more, greedy=1), load_checkpoint(folder)
    hidden = upstream.import_outputs(model, ids, more, 1)[3]
    where = upstream.first_departure(model, hidden, got.hidden, fp32["rel_l2"])
    assert where.startswith("first departs at layer 1 (attention)"), where


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts": 8}, "num_experts", "unknown"),
    ({"layer_types": ["conv", "attention", "full_attention"]}, "layer_types", "'sliding_attention'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters", "each attention layer type"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}}},
     "rope_parameters", "'proportional'"),
    ({"sliding_window": None}, "sliding_window", "at least 2"),
    ({"head_dim": None}, "head_dim", "positive integer"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"use_sandwich_norm": "yes"}, "use_sandwich_norm", "true or false"),
    ({"rms_norm_eps": 0.1}, "rms_norm_eps", "disagrees with norm_eps"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm3-sandwich-gate", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("lfm3-sandwich-gate", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", conv_L_cache=5), "model.layers.0.conv.conv.weight", "(32, 1, 7)")


def test_default_layer_types_follow_lfm3_config(tmp_path):
    """No layer_types: Lfm3Config's pattern, full attention at i % 4 == 2, sliding at i % 4 == 0 past layer 0."""
    f = check_fields({"num_hidden_layers": 9}, defaults=FIELDS, refused={}, importer="hf/lfm3", where=tmp_path / "config.json")
    c, s, a = "conv", "sliding_attention", "full_attention"
    assert read_layer_types(f, 9) == [c, c, a, c, s, c, a, c, s]
    assert json.loads(json.dumps(FIELDS))["conv_L_cache"] == 7 and FIELDS["sliding_window"] == 256
