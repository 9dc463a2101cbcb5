"""edgelin's import of Hugging Face transformers Mamba, Falcon-Mamba and (dense) Jamba checkpoints against
transformers' own model.

Same oracle as test_hf_mamba2.py (testkit/hf_oracle.py: transformers 5.x on its PyTorch path, in a subprocess): a
tiny random model, a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs logits error
<= 1e-4; the cache (the selective scan's state [B, I, N], the conv windows, Jamba's keys and values) is compared too.
The Mamba-1 layer (edgelin.layers.mamba) runs the selective scan of edgelin.ops.selective_scan; Falcon-Mamba adds
weightless RMSNorms on dt, B and C; Jamba puts the layer (with learned norms there) beside attention without
position encoding, an MLP in every block.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from testkit import hf_oracle, max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.stateful import (
    edited_copy, export_vs_reference, fused_export_vs_reference, import_vs_reference, pieces_and_steps_agree,
    protocol_and_naive_agree,
)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
VOCAB = 97
CASES = {  # id -> (model_type, config)
    # defaults: tied embeddings, the conv's bias, dt rank "auto" (2), no projection biases, a conv of 4 taps
    "mamba": ("mamba", {"vocab_size": VOCAB, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2}),
    # the weightless dt/B/C norms (their epsilon away from the default), projection biases but no conv bias, a conv of
    # 3 taps, an explicit dt rank, expand 3, untied embeddings
    "falcon-bias-conv3-untied": ("falcon_mamba", {
        "vocab_size": VOCAB, "hidden_size": 32, "state_size": 6, "num_hidden_layers": 2, "expand": 3, "conv_kernel": 3,
        "time_step_rank": 5, "use_bias": True, "use_conv_bias": False, "tie_word_embeddings": False, "mixer_rms_eps": 1e-4,
    }),
    # Mamba, attention (4 heads, 2 KV heads), Mamba; learned dt/B/C norms, projection biases, a conv of 3; experts
    # configured (num_experts 4) but on no layer of the three (every 4th from layer 3): a dense model
    "jamba-attn1": ("jamba", {
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "expert_layer_period": 4, "expert_layer_offset": 3, "attn_layer_period": 3,
        "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 3, "mamba_expand": 2, "mamba_dt_rank": 4,
        "mamba_proj_bias": True,
    }),
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    model_type, config = CASES[case_id]
    return hf_oracle.cached(_RESULTS, case_id, model_type, config, tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS,
                            vocab=VOCAB)


def test_registry_lists_mamba_and_its_relatives():
    assert {"mamba", "falcon_mamba", "jamba"} <= set(IMPORTERS)


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    family = CASES[case_id][0]
    kinds = [block.attn.kind for block in model.blocks]
    assert kinds == (["mamba", "attention", "mamba"] if family == "jamba" else ["mamba"] * 2)
    for i, block in enumerate(model.blocks):
        assert (block.mlp is None) is (family != "jamba")  # Mamba's blocks hold the mixer alone
        if block.attn.kind == "attention":
            assert block.attn.rotary == 0  # Jamba's attention has no position encoding
            for name in ("key", "value"):
                assert rel(state[f"{i}.{name}"], ref[f"{i}.{name}"]) <= STATE_REL
            continue
        assert (block.attn.o.bcdt_norm, hasattr(block.attn, "dt_layernorm")) == {
            "mamba": (None, False), "falcon_mamba": ("fixed", True), "jamba": ("learned", True)}[family]
        for name, theirs in (("S", "recurrent"), ("conv", "conv")):  # the same layouts: [B, I, N] and [B, I, K]
            got, want = state[f"{i}.{name}"], ref[f"{i}.{theirs}"]
            assert got.shape == want.shape and rel(got, want) <= STATE_REL
    assert model.max_positions == (262144 if family == "jamba" else None) and model.state_decays  # Jamba's default context


@pytest.mark.parametrize("T", [1, 7, 8, 9, 129, 300])
def test_the_selective_scan_forms_agree_under_strong_decays(T):
    """The chunk form (short chunks of 8 stepped through, their starts scanned in chunks of 16) and the one-token
    step against the naive loop in float64, with decays from ~1 to exp(-400) per step (dt up to ~20, A down to
    -20): lengths around a short chunk and past one chunk of them; float32 within 1e-5 of the float64 reference,
    relative to its scale."""
    from edgelin.ops.selective_scan import chunk_selective_scan, naive_selective_scan, selective_scan_step

    gen = torch.Generator().manual_seed(T)
    Bt, inner, N = 2, 6, 5
    x, b, c = torch.randn(Bt, T, inner, generator=gen), torch.randn(Bt, T, N, generator=gen), torch.randn(Bt, T, N, generator=gen)
    dt = torch.nn.functional.softplus(3 * torch.randn(Bt, T, inner, generator=gen))
    A, h0 = -20 * torch.rand(inner, N, generator=gen), torch.randn(Bt, inner, N, generator=gen)
    args64 = [t.double() for t in (x, dt, A, b, c, h0)]
    y_ref, h_ref = naive_selective_scan(*args64)
    y, h = chunk_selective_scan(*args64, chunk_size=16)
    assert max_abs(y, y_ref) <= 1e-10 * y_ref.abs().max() and max_abs(h, h_ref) <= 1e-10 * h_ref.abs().max()
    y, h = chunk_selective_scan(x, dt, A, b, c, h0, chunk_size=16)
    assert max_abs(y.double(), y_ref) <= 1e-5 * y_ref.abs().max() and max_abs(h.double(), h_ref) <= 1e-5 * h_ref.abs().max()
    y, h = selective_scan_step(*(t[:, :1] for t in args64[:2]), args64[2], *(t[:, :1] for t in args64[3:5]), args64[5])
    y1, h1 = naive_selective_scan(*(t[:, :1] for t in args64[:2]), args64[2], *(t[:, :1] for t in args64[3:5]), args64[5])
    assert max_abs(y, y1) <= 1e-12 and max_abs(h, h1) <= 1e-12


@pytest.mark.parametrize("case_id", ["falcon-bias-conv3-untied", "jamba-attn1"])
def test_protocol_forms_and_pieces(case_id, tmp_path_factory):
    """The protocol; the naive form (a per-token loop, conv included) against the chunk form in float64; prefill in
    pieces (1 token: shorter than the conv window; C - 1; C + 1) and token by token against one prefill."""
    folder, *_ = oracle(case_id, tmp_path_factory)
    model = load_checkpoint(folder)
    ids = torch.randint(0, VOCAB, (2, 129), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, f"hf/{CASES[case_id][0]}", ids)
    pieces_and_steps_agree(model, ids, (1, 63, 65))


def exported(tmp_path_factory):
    """(the portable export of the Mamba case, its export summary), made once per session."""
    if "export" not in _RESULTS:
        from edgelin.exporters import export

        folder, *_ = oracle("mamba", tmp_path_factory)
        out = tmp_path_factory.mktemp("mamba-export") / "export"
        _RESULTS["export"] = out, export(folder, out, check=False).summary()
    return _RESULTS["export"]


@pytest.mark.slow  # one export: ~40 s on a loaded 2-core machine
def test_export_matches_transformers(tmp_path_factory):
    """Both ONNX graphs of Mamba against transformers (no Loop or Scan node in the prefill graph: the chunked scan
    is unrolled), and validate against transformers itself (greedy ids included)."""
    import onnx

    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("mamba", tmp_path_factory)
    out, summary = exported(tmp_path_factory)
    assert "constant in sequence length" in summary, summary
    ops = {node.op_type for node in onnx.load(str(out / "prefill.onnx"), load_external_data=False).graph.node}
    assert not ops & {"Loop", "Scan"}, ops
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")
    assert report.passed, report.table()


@pytest.mark.slow  # the export above, in node
def test_the_javascript_runtime_runs_the_export(tmp_path_factory, tmp_path):
    """runtime/web/edgelin.mjs in node (onnxruntime-node) runs both graphs against the export's golden outputs."""
    from testkit.node import javascript_check

    out, _ = exported(tmp_path_factory)
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report


@pytest.mark.slow  # one export of a 3-layer model
def test_fused_export_matches_transformers(tmp_path_factory):
    """``--ops fused`` on Jamba: each Mamba layer's selective scan as ONNX Runtime's LinearAttention node (gated, one
    head per channel) and its conv as CausalConvWithState, in both graphs (the attention layer stays portable);
    both graphs against transformers' logits within the portable export's budget."""
    folder, prompt, steps, ref = oracle("jamba-attn1", tmp_path_factory)
    out = tmp_path_factory.mktemp("jamba-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")


def test_a_misread_field_departs_at_the_first_layer(tmp_path_factory, tmp_path):
    """transformers' run of the checkpoint (per-layer outputs, as validate's upstream check takes them) against the
    import of the same weights with one field edited: the dt/B/C norms' epsilon read as 0.5 departs at layer 0;
    the import of the checkpoint itself agrees at every layer."""
    from edgelin import parity, upstream

    folder, prompt, steps, _ = oracle("falcon-bias-conv3-untied", tmp_path_factory)
    prompt, steps = prompt[:, :70].numpy(), steps[:, :2].numpy()
    ref = upstream.run(folder, "transformers", prompt, steps, greedy=1)
    bound = parity.BUDGETS["fp32"]["upstream"]["rel_l2"]
    for checkpoint, said in ((folder, "every layer's output agrees"),
                             (edited_copy(folder, tmp_path / "ckpt", mixer_rms_eps=0.5), "first departs at layer 0 (mamba)")):
        model = load_checkpoint(checkpoint)
        prefill, *_, hidden = upstream.import_outputs(model, prompt, steps, 1)
        assert upstream.first_departure(model, hidden, ref.hidden, bound).startswith(said)
        assert parity.within(parity.errors(prefill, ref.prefill), parity.BUDGETS["fp32"]["upstream"]) is (checkpoint == folder)


@pytest.mark.parametrize("case_id, changes, field, fragment", [
    ("mamba", {"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ("mamba", {"time_step_rank": "full"}, "time_step_rank", "positive integer"),
    ("mamba", {"n_groups": 2}, "n_groups", "unknown"),
    ("falcon-bias-conv3-untied", {"mixer_rms_eps": 0}, "mixer_rms_eps", "positive"),
    ("jamba-attn1", {"num_experts": 4, "expert_layer_period": 2, "expert_layer_offset": 1}, "num_experts",
     "layers [1] a mixture of experts"),
    ("jamba-attn1", {"num_local_experts": 8, "expert_layer_offset": 0}, "num_local_experts", "layers [0] a mixture of experts"),
    ("jamba-attn1", {"attn_layer_offset": 3}, "attn_layer_offset", "below its period"),
    ("jamba-attn1", {"hidden_act": "gelu"}, "hidden_act", "'silu'"),
    ("jamba-attn1", {"sliding_window": 16}, "sliding_window", "unknown"),
])
def test_unsupported_options_are_refused_by_name(case_id, changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle(case_id, tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_weights_that_disagree_with_the_config_name_the_tensor(tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("mamba", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", state_size=4), "backbone.layers.0.mixer.A_log", "(64, 8)")
