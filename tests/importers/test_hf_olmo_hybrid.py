"""edgelin's import of Hugging Face transformers OLMo-hybrid checkpoints against transformers' own model.

The oracle is transformers 5.x's OlmoHybridForCausalLM with its whole forward (its PyTorch gated delta rule and
causal conv, its post-norm attention with q/k norms over the whole projection, its DynamicCache), run in a subprocess
(tests/testkit/hf_oracle.py, hooks in testkit/oracles/olmo_hybrid.py) that hides fla so transformers takes its PyTorch
paths. Tiny random hybrids of pre-norm Gated DeltaNet layers and post-norm attention layers interleaved, a 150-token
prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the cache (recurrent
states, conv windows, keys, values) is compared too.
"""

from __future__ import annotations

import pytest
import torch

from edgelin import parity, upstream
from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.importers.fields import check_fields
from edgelin.importers.hf.olmo_hybrid import FIELDS, read_layer_types, read_rope
from testkit import max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2

from testkit import hf_oracle
from testkit.stateful import (
    edited_copy, export_vs_reference, import_vs_reference, pieces_and_steps_agree,
    protocol_and_naive_agree,
)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
MAX_SEQUENCE = 256  # tokens per prefill call: a shorter scan in the prefill graph, a faster export (longer prompts go in pieces)
TINY = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2}
CASES = {
    # linear, attention, linear: 2 KV heads (GQA), head_dim 16 (not hidden / heads), RoPE at theta 5e5; Gated DeltaNet
    # with 2 key heads of 8 and 4 value heads of 6 (grouped), conv 4, beta in [0, 2] (linear_allow_neg_eigval), untied
    "olmo_hybrid-gqa-rope": {
        **TINY, "num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "num_key_value_heads": 2, "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 6,
    },
    # OlmoHybridConfig's default layer types for 2 layers (linear, then attention: the last one), no position encoding
    # (rope_theta null, as the released checkpoints), q/k/v/o biases, tied embeddings, beta in [0, 1], conv 3, the
    # default linear head sizes (4 heads of 6 keys and 12 values), rms_norm_eps 1e-5
    "olmo_hybrid-nope-bias-tied": {
        **TINY, "num_hidden_layers": 2, "rope_parameters": {"rope_type": "default", "rope_theta": None}, "attention_bias": True,
        "tie_word_embeddings": True, "linear_allow_neg_eigval": False, "linear_conv_kernel_dim": 3, "rms_norm_eps": 1e-5,
    },
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "olmo_hybrid", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


def test_registry_lists_olmo_hybrid():
    assert "olmo_hybrid" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    cfg = CASES[case_id]
    kinds = cfg.get("layer_types") or ["linear_attention", "full_attention"]
    for i, (block, kind) in enumerate(zip(model.blocks, kinds)):
        if kind == "full_attention":  # post-norm; transformers' cache [B, Hkv, P, D], keys after the norm and RoPE
            assert block.attn.kind == "attention" and block.placement == "post"
            nope = "rope_theta" in cfg["rope_parameters"] and cfg["rope_parameters"]["rope_theta"] is None
            assert block.attn.rotary == (0 if nope else block.attn.o.head_dim)
            assert state[f"{i}.key"].shape == ref[f"{i}.key"].shape
            assert rel(state[f"{i}.key"], ref[f"{i}.key"]) <= STATE_REL
            assert rel(state[f"{i}.value"], ref[f"{i}.value"]) <= STATE_REL
            assert state[f"{i}.pos"].tolist() == [PROMPT + STEPS] * BATCH
            continue
        # pre-norm Gated DeltaNet: recurrent state [B, Nv, K, V] (the same layout); transformers' one conv window
        # [B, 2 key + value, W] is edgelin's q, k and v windows stacked
        assert block.attn.kind == "fla/delta" and block.placement == "pre"
        assert block.attn.o.allow_neg_eigval == cfg.get("linear_allow_neg_eigval", True)
        assert state[f"{i}.S"].shape == ref[f"{i}.recurrent"].shape and rel(state[f"{i}.S"], ref[f"{i}.recurrent"]) <= STATE_REL
        conv = torch.cat([state[f"{i}.conv_q"], state[f"{i}.conv_k"], state[f"{i}.conv_v"]], dim=1)
        assert conv.shape == ref[f"{i}.conv"].shape and rel(conv, ref[f"{i}.conv"]) <= STATE_REL
    assert model.max_positions == 65536  # transformers' default max_position_embeddings: the declared context


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms (the delta rule's loop, attention per query) against the chunk form in float64;
    prefill in pieces of 1, chunk - 1 and chunk + 1 from a carried state, and token by token, against one prefill."""
    folder, *_ = oracle("olmo_hybrid-gqa-rope", tmp_path_factory)
    model = load_checkpoint(folder)
    chunk = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * chunk + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/olmo_hybrid", ids)
    assert not model.state_decays  # beta up to 2: the delta rule's state is not bounded
    pieces_and_steps_agree(model, ids, (1, chunk - 1, chunk + 1))


@pytest.mark.slow  # an export of a 3-layer hybrid, validate against transformers
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both graphs against transformers; validate passes, transformers included; no Loop or Scan, and the JavaScript
    runtime (node) matches the export's golden outputs; and a checkpoint whose linear_allow_neg_eigval
    is not what the import read departs at layer 0, the first Gated DeltaNet layer."""
    import onnx
    from testkit.node import javascript_check

    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("olmo_hybrid-gqa-rope", tmp_path_factory)
    out = tmp_path_factory.mktemp("olmo_hybrid-export") / "export"
    export(folder, out, check=False, max_sequence=MAX_SEQUENCE)
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()
    for graph in ("prefill", "decode"):  # no Loop or Scan: the delta rule's chunk form is MatMuls and CumSums
        nodes = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False).graph.node
        assert not {n.op_type for n in nodes} & {"Loop", "Scan"}, graph
    report = javascript_check(out, tmp_path)  # runtime/web/edgelin.mjs in node (onnxruntime-node): both graphs vs golden
    assert report["passed"] and len(report["results"]) == 2, report

    fp32 = parity.BUDGETS["fp32"]["upstream"]
    misread = edited_copy(folder, tmp_path / "misread", linear_allow_neg_eigval=False)
    ids, more = prompt[:, :40].numpy(), steps[:, :4].numpy()
    got, model = upstream.run(misread, "transformers", ids, more, greedy=1), load_checkpoint(folder)
    hidden = upstream.import_outputs(model, ids, more, 1)[3]
    where = upstream.first_departure(model, hidden, got.hidden, fp32["rel_l2"])
    assert where.startswith("first departs at layer 0 (fla/delta)"), where


@pytest.mark.parametrize("changes, field, fragment", [
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters", "unknown"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "rope_parameters", "'default'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1}}, "rope_parameters", "positive number"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types", "one 'full_attention'"),
    ({"layer_types": ["linear_attention", "attention", "full_attention"]}, "layer_types", "3 entries"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads", "multiple of linear_num_key_heads (2)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"linear_allow_neg_eigval": "yes"}, "linear_allow_neg_eigval", "true or false"),
    ({"attention_dropout": 2.0}, "attention_dropout", "[0, 1]"),
    ({"sliding_window": 16}, "sliding_window", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("olmo_hybrid-gqa-rope", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("olmo_hybrid-gqa-rope", tmp_path_factory)
    ckpt = edited_copy(folder, tmp_path / "ckpt", linear_conv_kernel_dim=3)
    refused(ckpt, "model.layers.0.linear_attn.conv1d.k.weight", "(16, 1, 4)")  # the k rows of q_conv1d | k_conv1d | v_conv1d


def test_default_layer_types_follow_olmo_hybrid_config(tmp_path):
    """No layer_types: OlmoHybridConfig's pattern, full attention at i % 4 == 3, else the last layer."""
    f = check_fields({}, defaults=FIELDS, refused={}, importer="hf/olmo_hybrid", where=tmp_path / "config.json")
    lin, att = "linear_attention", "full_attention"
    assert read_layer_types(f, 8) == [lin, lin, lin, att, lin, lin, lin, att]
    assert read_layer_types(f, 3) == [lin, lin, att]


@pytest.mark.parametrize("fields, theta", [
    ({}, 10000.0),  # rope_parameters absent or null: transformers 5.24 fills in the default RoPE, theta 10000
    ({"rope_parameters": None}, 10000.0),
    ({"rope_parameters": {"rope_type": "default"}}, 10000.0),
    ({"rope_theta": 5e5}, 5e5),  # the older top-level field
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 0.5}}, 2e4),  # factor: no effect
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, None),  # no position encoding
])
def test_rope_fields_read_as_transformers_does(fields, theta, tmp_path):
    f = check_fields(fields, defaults=FIELDS, refused={}, importer="hf/olmo_hybrid", where=tmp_path / "config.json")
    assert read_rope(f) == theta


def test_other_weight_layouts_load_the_same_model(tmp_path_factory, tmp_path):
    """The conv over [q | k | v] as three tensors of their own widths (transformers re-saves it in three equal
    row-chunks, which is what the oracle's folder holds), and as transformers' one in-memory ``conv1d`` with the
    in-memory norm names: the same model."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, prompt, _, ref = oracle("olmo_hybrid-gqa-rope", tmp_path_factory)
    tensors = load_file(folder / "model.safetensors")
    widths = (16, 16, 24)  # 2 key heads x 8, twice; 4 value heads x 6
    layouts = {"widths": {}, "in-memory": {}}
    for name, t in tensors.items():
        if name.endswith(".linear_attn.q_conv1d.weight"):
            prefix = name[: -len("q_conv1d.weight")]
            conv = torch.cat([tensors[prefix + f"{p}_conv1d.weight"] for p in "qkv"])
            assert [tensors[prefix + f"{p}_conv1d.weight"].shape[0] for p in "qkv"] != list(widths)  # equal chunks
            layouts["widths"].update({prefix + f"{p}_conv1d.weight": part for p, part in zip("qkv", conv.split(widths))})
            layouts["in-memory"][prefix + "conv1d.weight"] = conv
        elif "_conv1d." not in name:
            layouts["widths"][name] = t
            # transformers' renaming on load, in every layer (an attention layer's post-attention norm included)
            renamed = name.replace("attention_layer_norm", "input_layernorm")
            layouts["in-memory"][renamed.replace("feedforward_layer_norm", "post_attention_layernorm")] = t
    for layout, weights in layouts.items():
        out = tmp_path / layout
        out.mkdir()
        shutil.copy(folder / "config.json", out / "config.json")
        save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
        with torch.no_grad():
            assert max_abs(load_checkpoint(out)(prompt)[0], ref["prefill"]) <= MAX_ABS, layout
