"""edgelin's import of flash-linear-attention Kimi Delta Attention (``kda``) and Gated DeltaProduct
(``gated_deltaproduct``) checkpoints against fla's own models.

The oracle as in test_fla_delta.py: a tiny random fla model per case (built and saved with the real package), fla's
real ``fused_recurrent`` kernels (fused_recurrent_kda; GatedDeltaProduct's interleaved fused_recurrent_gated_delta_rule)
in Triton's CPU interpreter over 69 prompt tokens and 12 decode steps, batch 2; edgelin runs the prefill through the
delta rule's chunk form (KDA: per-channel decays, C = 32; DeltaProduct: the interleaved steps) and the decode through
its step. Budget, fp32: max abs logits error <= 1e-4 at every position; the final states (S, the conv windows) too.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.runtime.manifest import Manifest
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.node import javascript_check
from testkit.delta import strong_gates
from testkit.stateful import (
    edited_copy, export_vs_reference, fused_export_vs_reference, pieces_and_steps_agree, protocol_and_naive_agree,
)

MAX_ABS = 1e-4
STATE_REL = 1e-5  # S and the conv windows, relative L2
BATCH, PROMPT, STEPS = 2, 69, 12  # past chunk boundaries: KDA's chunk of 32 twice, DeltaProduct's of 64 once (fla in the interpreter costs by the token)
SMALL = {"head_dim": 16}  # the families' default head_dim (128, 256) is larger than the tiny model


CASES = {  # id -> (model_type, fla config options; "edit": a change to the saved tensors)
    # convs of 4, expand_v 1, the softplus gate
    "kda-default-strong_gates": ("kda", {**SMALL, "edit": strong_gates}),
    # grouped value heads, expand_v 2, lower_bound's sigmoid gate (safe_gate: a kernel hint), beta in [0, 2], no convs,
    # tied embeddings (fla's ``attn`` hybrids: read as for every fla family, run against fla in test_fla_hybrid.py)
    "kda-gva-lower_bound-neg_eigval-no_conv-tied": (
        "kda", {
            **SMALL, "num_heads": 2, "num_v_heads": 4, "expand_v": 2.0, "lower_bound": -5.0, "safe_gate": True,
            "allow_neg_eigval": True, "use_short_conv": False, "tie_word_embeddings": True,
        },
    ),
    # 2 Householder steps per token after the gate, beta in [0, 2], the swish output gate, convs of 3, expand_v 2
    # (one layer each: fla's interleaved runs are the slowest oracles here; KDA's cases stack two layers of the same kind)
    "gated_deltaproduct-n2-forget_gate-neg_eigval-conv3-1layer": (
        "gated_deltaproduct", {
            **SMALL, "num_householder": 2, "use_forget_gate": True, "allow_neg_eigval": True, "conv_size": 3,
            "num_hidden_layers": 1,
        },
    ),
    # 3 steps, no gate (DeltaProduct), no output gate, no convs, expand_v 1
    "gated_deltaproduct-n3-no_forget_gate-no_output_gate-no_conv-1layer": (
        "gated_deltaproduct", {
            **SMALL, "num_householder": 3, "use_output_gate": False, "use_short_conv": False, "expand_v": 1.0,
            "num_hidden_layers": 1,
        },
    ),
}
STEPWISE = ("kda-default-strong_gates",)  # fla's own decode path, one step at a time; the rest in one forward
EXPORTED = "kda-default-strong_gates"
_RESULTS: dict[str, tuple] = {}


def fla_case(case_id: str, fla_oracle, tmp_path_factory):
    """(checkpoint folder, prompt, steps, fla's results with its raw cache) for one case, once per session."""
    model_type, options = CASES[case_id]
    return fla_oracle.cached_case(_RESULTS, case_id, model_type, options, tmp_path_factory, batch=BATCH, prompt=PROMPT,
                                  steps=STEPS, stepwise=case_id in STEPWISE)


def same_worker(case_ids):
    """An exported case's import and export tests share one xdist worker, so fla's run of it happens once."""
    return [pytest.param(c, marks=pytest.mark.xdist_group(f"fla-{c}")) if c == EXPORTED else c for c in case_ids]


@pytest.mark.parametrize("case_id", same_worker(CASES))
def test_import_matches_fla(case_id, fla_oracle, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_cache) = fla_case(case_id, fla_oracle, tmp_path_factory)
    model, state = fla_oracle.import_vs_fla(folder, prompt, steps, ref_prefill, ref_decode, MAX_ABS)
    for layer, cache in enumerate(ref_cache):
        o = model.blocks[layer].attn.o
        S = cache["recurrent_state"]  # fla: KDA [B, HV, V, K] (value first), GatedDeltaProduct [B, H, K, V]
        if o.channel_decay:
            S = S.transpose(-1, -2)
        got = state[f"{layer}.S"]
        assert got.shape == S.shape == (BATCH, o.num_v_heads, o.head_k_dim, o.head_v_dim), f"{layer}.S: {tuple(got.shape)}"
        assert rel(got, S) <= STATE_REL, f"{layer}.S: relative L2 {rel(got, S):.2e}"
        expected = {"S"} | ({"conv_q", "conv_k", "conv_v"} if o.short_conv else set())
        assert {k.split(".", 1)[1] for k in state if k.startswith(f"{layer}.")} == expected
        for name, window in zip(("conv_q", "conv_k", "conv_v"), cache["conv_state"] or ()):
            got = state[f"{layer}.{name}"]
            assert got.shape == window.shape and rel(got, window) <= STATE_REL, f"{layer}.{name}"


@pytest.mark.slow  # an export with the delta rule's scan, validate against fla in Triton's interpreter, node
def test_export_matches_fla(fla_oracle, tmp_path_factory, tmp_path):
    """KDA's export (the per-channel chunk form in the prefill graph): the two ONNX graphs in ONNX Runtime, driven
    from the manifest alone, against fla; no Loop or Scan in them; the prefill graph at T = 1, C - 1, C, C + 1 and
    300 against the import; edgelin's validate against the checkpoint with fla itself run (upstream required)
    passes; the JavaScript runtime in node matches the export's golden outputs; the fused export (``--ops fused``)
    against fla. (Gated DeltaProduct's graphs, the delta rule's over the interleaved steps, were measured by hand:
    not exported here, for the suite's time.)"""
    import onnx

    from edgelin.exporters import export
    from edgelin.runtime import load
    from edgelin.validate import validate

    folder, prompt, steps, (ref_prefill, ref_decode, _) = fla_case(EXPORTED, fla_oracle, tmp_path_factory)
    out = tmp_path_factory.mktemp("kda-export") / "export"
    export(folder, out, check=False, max_sequence=512)
    manifest = Manifest.load(out)
    assert manifest.model["family"] == "fla/kda"
    for file in manifest.graphs.values():
        ops = {node.op_type for node in onnx.load(str(out / file), load_external_data=False).graph.node}
        assert not {"Loop", "Scan", "If"} & ops, file
    export_vs_reference(out, prompt, steps, ref_prefill, ref_decode, MAX_ABS, against="fla")
    model, session = load_checkpoint(folder), load(out, provider="cpu")
    C = model.chunk_size
    ids = torch.randint(0, 97, (BATCH, 300), generator=torch.Generator().manual_seed(3))
    for T in (1, C - 1, C, C + 1, 300):
        with torch.no_grad():
            ref = model(ids[:, :T])[0]
        got = torch.from_numpy(session.prefill(ids[:, :T].numpy(), session.new_state(BATCH)))
        assert (got - ref).abs().max() <= MAX_ABS, T
    report = validate(out, folder, steps=16, upstream="required")
    assert report.passed, report.table()
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report
    # --ops fused: one LinearAttention node per layer (gated_delta, the decay per channel [B, T, HV K]) and one
    # CausalConvWithState per conv, in both graphs, against fla
    fused_out = tmp_path_factory.mktemp("kda-fused") / "export"
    fused_export_vs_reference(folder, fused_out, prompt, steps, ref_prefill, ref_decode, MAX_ABS, against="fla")


# ---- reading the checkpoints (fla builds them; none of its kernels run) -----------------------------------------


@pytest.fixture(scope="module")
def bases(fla_oracle, tmp_path_factory):
    root = tmp_path_factory.mktemp("kda-bases")
    return {
        "kda": fla_oracle.build(root / "kda", model_type="kda", **SMALL, num_heads=2, num_v_heads=4, expand_v=2.0),
        "gated_deltaproduct": fla_oracle.build(
            root / "gdp", model_type="gated_deltaproduct", **SMALL, num_householder=2, use_forget_gate=True,
        ),
    }


def test_registry_lists_the_families():
    assert {"kda", "gated_deltaproduct"} <= set(IMPORTERS)


@pytest.mark.parametrize("model_type", ["kda", "gated_deltaproduct"])
def test_loads_as_a_protocol_model_and_its_forms_agree(bases, model_type):
    """The protocol; the state layout (per value head, key-major; fla's conv windows, n times wider for the
    product); the naive loops give the chunk form's logits and state in float64, over two chunks and one more."""
    model = load_checkpoint(bases[model_type])
    specs = {s.key: (s.shape, s.dtype) for s in model.state_specs()}
    if model_type == "kda":  # 4 value heads of 16 x 32 reading 2 query/key heads; the prefill chunk 32
        assert model.chunk_size == 32
        assert specs["0.S"] == (("batch", 4, 16, 32), "float32") and specs["0.conv_v"] == (("batch", 128, 4), "float32")
        assert specs["0.conv_q"] == specs["0.conv_k"] == (("batch", 32, 4), "float32")
        assert model.state_decays
    else:  # 4 heads of 16 x 32 (expand_v 2), 2 keys and values per token
        assert specs["0.S"] == (("batch", 4, 16, 32), "float32") and specs["0.conv_v"] == (("batch", 256, 4), "float32")
        assert specs["0.conv_q"] == (("batch", 64, 4), "float32") and specs["0.conv_k"] == (("batch", 128, 4), "float32")
    ids = torch.randint(0, 97, (2, 2 * model.chunk_size + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, f"fla/{model_type}", ids)
    with torch.no_grad():  # the recurrent form and another chunk length too
        m64 = model.double()
        ref, ref_state = m64(ids, form="naive")
        for form, m in (("chunk", m64.with_chunk_size(7)), ("recurrent", m64)):
            logits, state = m(ids, form=form)
            assert (logits - ref).abs().max() <= 1e-10, form
            for key, value in ref_state.items():
                assert (state[key] - value).abs().max() <= 1e-10, (form, key)


@pytest.mark.parametrize("model_type", ["kda", "gated_deltaproduct"])
def test_prefill_in_pieces_and_token_by_token_agree(bases, model_type):
    """Prefill pieces of 1, C - 1, C + 1 tokens from a carried state and the decode step token by token give one
    prefill's logits and state."""
    model = load_checkpoint(bases[model_type])
    C = model.chunk_size
    ids = torch.randint(0, 97, (2, 2 * C + 1), generator=torch.Generator().manual_seed(2))
    pieces_and_steps_agree(model, ids, (1, C - 1, C + 1))


@pytest.mark.parametrize("model_type, field, value, fragment", [
    pytest.param("kda", "num_v_heads", 3, "multiple of num_heads (2)", id="kda-num_v_heads"),
    pytest.param("kda", "expand_v", 1.03, "must be an integer", id="kda-expand_v"),
    pytest.param("kda", "lower_bound", 0.5, "negative number", id="kda-lower_bound"),
    pytest.param("kda", "safe_gate", True, "without a lower_bound", id="kda-safe_gate"),
    pytest.param("kda", "attn_mode", "fused_chunk", "'fused_recurrent'", id="kda-attn_mode"),
    pytest.param("kda", "attnres_block_size", 2, "attention residuals", id="kda-attnres"),
    pytest.param("kda", "use_gate", True, "unknown", id="kda-unknown-field"),
    pytest.param("gated_deltaproduct", "num_householder", 0, "positive integer", id="gdp-num_householder"),
    pytest.param("gated_deltaproduct", "use_forget_gate", "yes", "true or false", id="gdp-use_forget_gate"),
    pytest.param("gated_deltaproduct", "num_v_heads", 8, "unknown", id="gdp-num_v_heads"),
    pytest.param("gated_deltaproduct", "hidden_act", "gelu", "'swish'", id="gdp-hidden_act"),
])
def test_unsupported_option_is_refused_by_name(bases, tmp_path, model_type, field, value, fragment, refused):
    refused(edited_copy(bases[model_type], tmp_path / "ckpt", **{field: value}), repr(field), fragment)


def test_weights_of_another_householder_count_are_refused(bases, tmp_path, refused):
    refused(edited_copy(bases["gated_deltaproduct"], tmp_path / "ckpt", num_householder=3), "has shape", "the config expects")


@pytest.mark.parametrize("model_type", ["kda", "gated_deltaproduct"])
def test_the_attn_field_makes_a_hybrid(fla_oracle, tmp_path, monkeypatch, model_type):
    """fla's ``attn`` puts its softmax Attention at the listed layers, as for every fla family (edgelin.importers.fla;
    fla's hybrids run against edgelin in test_fla_hybrid.py). fla builds its Attention only where flash-attn imports:
    a placeholder stands in for it here (nothing runs)."""
    import fla.layers.attn as attn

    monkeypatch.setattr(attn, "flash_attn_func", lambda *args, **kwargs: None)
    folder = fla_oracle.build(tmp_path / "hybrid", model_type=model_type, **SMALL, attn={"layers": [1], "num_heads": 4})
    model = load_checkpoint(folder)
    assert [block.attn.kind for block in model.blocks] == ["fla/delta", "attention"]
    assert {key.split(".")[0] for key in (s.key for s in model.state_specs())} == {"0", "1"}
