"""edgelin's import of Hugging Face transformers Falcon-H1 checkpoints against transformers' own model.

Same oracle as test_hf_mamba2.py (testkit/hf_oracle.py with testkit/oracles/falcon_h1.py: transformers 5.x's
FalconH1ForCausalLM on its PyTorch path, in a subprocess): a tiny random model, a 150-token prefill then 20 cached
decode steps, batch 2. Budget, fp32: max abs logits error <= 1e-4; the cache (keys, values, SSM states, conv
windows) is compared too. Every layer runs attention and Mamba2 side by side (edgelin.layers.parallel); the μP
multipliers are folded into the weights, or kept in the graph where the embeddings are tied.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from testkit import hf_oracle, max_abs
from testkit.node import javascript_check
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.stateful import (edited_copy, export_vs_reference, import_vs_reference,
                              pieces_and_steps_agree, protocol_and_naive_agree)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "mamba_d_state": 8}
MULTIPLIERS = {  # every μP multiplier away from 1
    "embedding_multiplier": 2.0, "lm_head_multiplier": 0.7, "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8,
    "key_multiplier": 1.5, "ssm_in_multiplier": 0.6, "ssm_out_multiplier": 1.4, "ssm_multipliers": [0.5, 1.5, 0.7, 1.3, 0.9],
    "mlp_multipliers": [1.2, 0.75],
}
CASES = {
    # GQA (4 heads, 2 KV heads of 12: head_dim set apart from hidden / heads), Mamba2 of mamba_d_ssm 48 (not
    # expand x hidden) in 6 heads of 8 and 2 groups, the gated norm after the gate's default (norm, then gate);
    # every multiplier folded into the weights (untied)
    "gqa-multipliers-norm": {
        **TINY, **MULTIPLIERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "mamba_d_ssm": 48,
        "mamba_n_heads": 6, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_rms_norm": True,
    },
    # tied embeddings (embedding and lm_head multipliers kept in the graph), biases on attention, on Mamba2's in_proj
    # and on its out_proj (projectors_bias), none on the conv of 3 taps; the norm gated first; inner width from
    # mamba_expand (mamba_d_ssm null), one group; another rope_theta
    "tied-biases-gate-first": {
        **TINY, **MULTIPLIERS, "tie_word_embeddings": True, "num_attention_heads": 4, "num_key_value_heads": 4,
        "attention_bias": True, "mamba_proj_bias": True, "projectors_bias": True, "mamba_conv_bias": False, "mamba_d_conv": 3,
        "mamba_d_ssm": None, "mamba_expand": 2, "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_rms_norm": True,
        "mamba_norm_before_gate": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
    },
    # transformers' defaults for the norm: no gated norm (y * silu(z)); MHA, default multipliers
    "no-norm": {**TINY, "num_attention_heads": 2, "num_key_value_heads": 2, "mamba_d_ssm": 32, "mamba_n_heads": 4,
                "mamba_n_groups": 1, "mamba_d_conv": 4},
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "falcon_h1", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


def test_registry_lists_falcon_h1():
    assert "falcon_h1" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    config = CASES[case_id]
    for i, block in enumerate(model.blocks):
        assert block.attn.kind == "parallel" and list(block.attn.members) == ["mamba", "attention"]
        assert set(block.attn.scales.values()) == {1.0}  # every multiplier folded into the weights
        assert (block.attn.members["mamba"].o.rms_norm, block.attn.members["mamba"].o.norm_before_gate) == (
            config.get("mamba_rms_norm", False), config.get("mamba_norm_before_gate", True))
        for name in ("key", "value"):
            assert state[f"{i}.attention.{name}"].shape == ref[f"{i}.{name}"].shape
            assert rel(state[f"{i}.attention.{name}"], ref[f"{i}.{name}"]) <= STATE_REL
        S = ref[f"{i}.recurrent"].transpose(-1, -2)  # transformers: [B, H, P, N]; edgelin: [B, H, N, P]
        assert state[f"{i}.mamba.S"].shape == S.shape and rel(state[f"{i}.mamba.S"], S) <= STATE_REL
        conv = state[f"{i}.mamba.conv"]
        assert conv.shape == ref[f"{i}.conv"].shape and rel(conv, ref[f"{i}.conv"]) <= STATE_REL
        assert state[f"{i}.attention.pos"].tolist() == [PROMPT + STEPS] * BATCH
    tied = config.get("tie_word_embeddings", False)
    assert (model.embed_scale, model.logits_scale) == ((2.0, 1 / 0.7) if tied else (1.0, 1.0))
    assert model.max_positions == 8192 and model.state_decays  # transformers' default max_position_embeddings


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; every member's naive form against the chunk form in float64; prefill in pieces (1 token:
    shorter than the conv window; C - 1; C + 1) and token by token against one prefill."""
    folder, *_ = oracle("gqa-multipliers-norm", tmp_path_factory)
    model = load_checkpoint(folder)
    C = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * C + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/falcon_h1", ids)
    pieces_and_steps_agree(model, ids, (1, C - 1, C + 1))


def test_a_parallel_layer_sums_its_scaled_members_and_unites_their_states():
    """y = sum of scale_m * member_m(x); the state is each member's, its names prefixed by the member's."""
    from edgelin.layers.attention import Attention, AttentionOptions
    from edgelin.layers.mamba2 import Mamba2Mixer, Mamba2Options
    from edgelin.layers.parallel import Parallel

    torch.manual_seed(0)
    attention = Attention(AttentionOptions(d_model=16, num_heads=2, num_kv_heads=1, head_dim=8))
    mamba = Mamba2Mixer(Mamba2Options(d_model=16, num_heads=4, head_dim=8, state_size=4, n_groups=2, conv_kernel=3))
    layer = Parallel({"mamba": mamba, "attention": attention}, {"attention": 0.25, "mamba": -2.0})
    assert list(layer.state_layout()) == ["mamba.S", "mamba.conv", "attention.key", "attention.value", "attention.pos"]
    assert layer.forms == ("chunk", "naive", "step") and not layer.accepts_lengths and layer.bounded_state
    x = torch.randn(2, 5, 16)
    fresh = {name: torch.zeros(2, *[0 if d == "past" else d for d in entry[0][1:]], dtype=getattr(torch, entry[1]))
             for name, entry in layer.state_layout().items()}
    with torch.no_grad():
        y, state = layer(x, fresh, form="chunk", chunk_size=4)
        a, a_state = attention(x, {k.split(".", 1)[1]: v for k, v in fresh.items() if k.startswith("attention.")}, form="chunk")
        m, m_state = mamba(x, {k.split(".", 1)[1]: v for k, v in fresh.items() if k.startswith("mamba.")}, chunk_size=4)
    assert max_abs(y, 0.25 * a - 2.0 * m) <= 1e-6
    assert set(state) == set(fresh)
    assert torch.equal(state["attention.key"], a_state["key"]) and torch.equal(state["mamba.S"], m_state["S"])
    with pytest.raises(ValueError, match="without '.'"):
        Parallel({"a.b": attention})
    with pytest.raises(ValueError, match="not a member"):
        Parallel({"attention": attention}, {"mamba": 2.0})


@pytest.mark.slow  # one export: ~1 min on a loaded 2-core machine
def test_export_matches_transformers(tmp_path_factory, tmp_path):
    """Both ONNX graphs against transformers, validate against transformers itself; then the same checkpoint with
    one field edited (mamba_norm_before_gate false): transformers on that folder departs from the export at
    layer 0."""
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("gqa-multipliers-norm", tmp_path_factory)
    out = tmp_path_factory.mktemp("falcon-h1-export") / "export"
    summary = export(folder, out, check=False).summary()
    assert "per position of context" in summary and "constant in sequence length" not in summary, summary
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()
    report = javascript_check(out, tmp_path)  # runtime/web/edgelin.mjs in node (onnxruntime-node): both graphs vs golden
    assert report["passed"] and len(report["results"]) == 2, report


def test_a_misread_field_departs_at_the_first_layer(tmp_path_factory, tmp_path):
    """transformers' run of the checkpoint (per-layer outputs, as validate's upstream check takes them) against the
    import of the same weights with one field edited: the norm-before-gate option read the other way departs at
    layer 0; the import of the checkpoint itself agrees at every layer."""
    from edgelin import parity, upstream

    folder, prompt, steps, _ = oracle("gqa-multipliers-norm", tmp_path_factory)
    prompt, steps = prompt[:, :70].numpy(), steps[:, :2].numpy()
    ref = upstream.run(folder, "transformers", prompt, steps, greedy=1)
    bound = parity.BUDGETS["fp32"]["upstream"]["rel_l2"]
    misread = edited_copy(folder, tmp_path / "ckpt", mamba_norm_before_gate=False)
    for checkpoint, said in ((folder, "every layer's output agrees"), (misread, "first departs at layer 0 (parallel)")):
        model = load_checkpoint(checkpoint)
        prefill, *_, hidden = upstream.import_outputs(model, prompt, steps, 1)
        assert upstream.first_departure(model, hidden, ref.hidden, bound).startswith(said)
        assert parity.within(parity.errors(prefill, ref.prefill), parity.BUDGETS["fp32"]["upstream"]) is (checkpoint == folder)


@pytest.mark.parametrize("changes, field, fragment", [
    ({"mlp_bias": True}, "mlp_bias", "false only"),
    ({"mamba_use_mlp": False}, "mamba_use_mlp", "always has an MLP"),
    ({"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ({"ssm_multipliers": [1.0, 1.0]}, "ssm_multipliers", "must list 5 positive finite numbers"),
    ({"mlp_multipliers": [1.0, -1.0]}, "mlp_multipliers", "must list 2 positive finite numbers"),
    ({"key_multiplier": 0}, "key_multiplier", "positive"),
    ({"mamba_d_head": 5}, "mamba_d_head", "must equal mamba_d_ssm (48)"),
    ({"mamba_n_groups": 4}, "mamba_n_groups", "must divide mamba_n_heads (6)"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters", "'factor'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters", "'default'"),
    ({"time_step_limit": [0.5, 0.1]}, "time_step_limit", "0 <= low <= high"),
    ({"num_experts": 4}, "num_experts", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("gqa-multipliers-norm", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("no-norm", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", mamba_rms_norm=True), "model.layers.0.mamba.norm.weight", "missing")
