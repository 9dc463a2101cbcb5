"""edgelin's import of Hugging Face transformers Qwen3-Next checkpoints (dense MLPs) against transformers' own model
(with experts: test_hf_qwen3_next_moe.py).

The oracle is transformers 5.x's Qwen3NextForCausalLM with its whole forward (its fused in_proj_qkvz / in_proj_ba
projections grouped by key head, its PyTorch gated delta rule and causal conv, its gated attention, its
DynamicCache), run in a subprocess that hides fla (tests/testkit/hf_oracle.py). Tiny random hybrids, a 150-token
prefill then 20 cached decode steps, batch 2; fp32 budget max abs logits <= 1e-4; the cache is compared too.
Two value heads per key head in one case and three in the other, with key and value head widths that differ, so a
row of the fused projections read from the wrong group or piece shows.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.importers.hf.qwen3_next import group_rows
from testkit import hf_oracle
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.stateful import edited_copy, fused_export_vs_reference, import_vs_reference

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "num_experts": 0,
}
CASES = {
    # 3 Gated DeltaNet layers then attention (every 4th), two value heads per key head, no experts
    "qwen3_next-dense4": {**TINY, "num_hidden_layers": 4},
    # experts configured but every layer listed dense (mlp_only_layers), attention first, tied embeddings, three
    # value heads per key head (value head width 12), conv 3, half-width RoPE
    "qwen3_next-mlp-only-tied": {
        **TINY, "num_hidden_layers": 3, "num_experts": 4, "mlp_only_layers": [0, 1, 2],
        "layer_types": ["full_attention", "linear_attention", "linear_attention"], "tie_word_embeddings": True,
        "linear_num_value_heads": 6, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    return hf_oracle.cached(_RESULTS, case_id, "qwen3_next", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=TINY["vocab_size"])



def test_registry_lists_qwen3_next():
    assert "qwen3_next" in IMPORTERS


def test_group_rows_reads_a_grouped_layout():
    # two groups of [2 | 1 | 3]: rows 0-5 are group 0, rows 6-11 group 1
    assert group_rows(2, (2, 1, 3)) == [[[0, 1], [6, 7]], [[2], [8]], [[3, 4, 5], [9, 10, 11]]]


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    assert model.model_config()["family"] == "hf/qwen3_next"
    kinds = {"fla/delta": 0, "attention": 0}
    for i, block in enumerate(model.blocks):
        kinds[block.attn.kind] += 1
        if block.attn.kind == "attention":
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL and rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
        else:  # the recurrent state [B, Nv, K, V] and the conv window over [q | k | v] in transformers' own layouts
            assert state[f"{i}.S"].shape == ref[f"{i}.recurrent"].shape and rel(state[f"{i}.S"], ref[f"{i}.recurrent"]) <= STATE_REL
            assert state[f"{i}.conv"].shape == ref[f"{i}.conv"].shape and rel(state[f"{i}.conv"], ref[f"{i}.conv"]) <= STATE_REL
    assert kinds["attention"] >= 1 and kinds["fla/delta"] >= 2


def test_fused_export_matches_transformers(tmp_path_factory):
    """Both ONNX graphs (``--ops fused``: the delta rule as ONNX Runtime's LinearAttention node) against transformers'
    logits. The portable graphs are Qwen3.5's (the same model once the rows are unpacked; test_hf_qwen3_5.py exports
    them)."""
    folder, prompt, steps, ref = oracle("qwen3_next-mlp-only-tied", tmp_path_factory)
    out = tmp_path_factory.mktemp("qwen3_next-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    # `edgelin bench EXPORT` on an imported export: its PyTorch rows get the importer's model of the manifest's
    # source_config (random weights), its ORT rows run the export
    from edgelin.bench import run_bench

    report = run_bench(out, sections=["decode"], quick=True, threads=1, out_dir=out.parent / "bench", plots=False)
    row = json.loads(report.json_path.read_text())["decode"]["batches"]["1"]
    assert row["torch_eager"]["median"] > 0 and row["ort_iobinding"]["median"] > 0


@pytest.mark.parametrize("changes, field, fragment", [
    ({"num_experts": -1}, "num_experts", "non-negative integer"),
    ({"mlp_only_layers": "all"}, "mlp_only_layers", "list of layer indices"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads", "multiple of linear_num_key_heads (2)"),
    ({"attention_bias": True}, "attention_bias", "false only"),
    ({"sliding_window": 16}, "sliding_window", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_next-dense4", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_dense_layers_ignore_the_expert_fields(tmp_path_factory, tmp_path):
    """With no layer sparse (decoder_sparse_step beyond the stack), the expert sizes are not read: the same model."""
    folder, prompt, _, ref = oracle("qwen3_next-dense4", tmp_path_factory)
    out = edited_copy(folder, tmp_path / "ckpt", num_experts=8, decoder_sparse_step=5, moe_intermediate_size=7, num_experts_per_tok=3)
    with torch.no_grad():
        assert (load_checkpoint(out)(prompt)[0] - ref["prefill"]).abs().max().item() <= MAX_ABS


def test_fused_rows_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("qwen3_next-dense4", tmp_path_factory)
    # value heads of width 4 instead of 8: the fused projection has 2 * 32 + 2 * 16 = 96 rows, not 128
    refused(edited_copy(folder, tmp_path / "ckpt", linear_value_head_dim=4), "model.layers.0.linear_attn.in_proj_qkvz.weight", "96 rows")
