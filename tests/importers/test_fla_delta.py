"""edgelin's import of flash-linear-attention DeltaNet and Gated DeltaNet checkpoints against fla's own model.

Same oracle as test_fla_gated.py: a tiny random fla model per case (built and saved with the real package), fla's
real ``fused_recurrent`` delta-rule kernels in Triton's CPU interpreter over 69 prompt tokens and 12 decode
steps (each family's default case through fla's cache one step at a time, the others in one forward), batch 2; edgelin runs the prefill through the delta rule's chunk (WY) form and the decode through its
step. Budget, fp32: max abs logits error <= 1e-4 at every position. The final states (S, the conv windows) are
compared too. Hybrids of these families (fla's ``attn``) are in test_fla_hybrid.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.protocol import ExportableModel, check_model
from edgelin.runtime.manifest import Manifest
from testkit import max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.delta import strong_gates
from testkit.stateful import edited_copy, pieces_and_steps_agree

MAX_ABS = 1e-4
STATE_REL = 1e-5  # S and the conv windows, relative L2
BATCH, PROMPT, STEPS = 2, 69, 12  # a chunk of 64 and 5 more (fla in the interpreter costs by the token)
SMALL = {"head_dim": 16}  # Gated DeltaNet's default head_dim (256) is larger than the tiny model


CASES = {  # id -> (model_type, fla config options; "edit": a change to the saved tensors)
    # fla's defaults (expand_v 2, output gate, convs of 4); fla's own fused block norms and SwiGLU kernels are
    # held to their PyTorch forms by the other families' default cases (they cost minutes in the interpreter)
    "gated_deltanet-default": ("gated_deltanet", {**SMALL}),
    "gated_deltanet-gva-neg_eigval-sigmoid_gate-conv3-expand_v1.5": (
        "gated_deltanet", {
            **SMALL, "num_heads": 2, "num_v_heads": 4, "expand_v": 1.5, "allow_neg_eigval": True,
            "output_gate_activation": "sigmoid", "conv_size": 3, "fuse_norm": False,
        },
    ),
    "gated_deltanet-no_gate-no_conv-strong_gates-tied": (
        "gated_deltanet", {**SMALL, "use_gate": False, "use_short_conv": False, "tie_word_embeddings": True, "edit": strong_gates},
    ),
    "delta_net-default": ("delta_net", {}),  # silu, l2 norm, beta, convs of 4, no gate
    "delta_net-sum-relu-no_beta-neg_eigval-gate-no_conv": (
        "delta_net", {
            "qk_norm": "sum", "qk_activation": "relu", "use_beta": False, "allow_neg_eigval": True, "use_gate": True,
            "use_short_conv": False,
        },
    ),
    "delta_net-identity-tied": ("delta_net", {"qk_activation": "identity", "tie_word_embeddings": True}),  # convs of 4, no activation
    "delta_net-elu-conv2-expand_k0.5-expand_v2-strong_beta-no_output_norm_flag": (
        "delta_net", {
            "qk_activation": "elu", "conv_size": 2, "expand_k": 0.5, "expand_v": 2.0, "use_output_norm": False,
            "edit": strong_gates,
        },
    ),
}
# Exported: grouped value heads, beta in [0, 2], the sigmoid gate, convs of 3; DeltaNet's sum norm without convs.
EXPORTED = ("gated_deltanet-gva-neg_eigval-sigmoid_gate-conv3-expand_v1.5", "delta_net-sum-relu-no_beta-neg_eigval-gate-no_conv")

STEPWISE = ("gated_deltanet-default", "delta_net-default")  # fla's own decode path; the rest in one forward
_RESULTS: dict[str, tuple] = {}


def same_worker(case_ids):
    """As in test_fla_gated.py: an exported case's import and export tests share one xdist worker, so fla's run
    of it (the slow part) happens once."""
    return [pytest.param(c, marks=pytest.mark.xdist_group(f"fla-{c}")) if c in EXPORTED else c for c in case_ids]


def fla_case(case_id: str, fla_oracle, tmp_path_factory):
    """(checkpoint folder, prompt, steps, fla's results with its raw cache) for one case, once per session."""
    model_type, options = CASES[case_id]
    return fla_oracle.cached_case(_RESULTS, case_id, model_type, options, tmp_path_factory, batch=BATCH, prompt=PROMPT,
                                  steps=STEPS, stepwise=case_id in STEPWISE)


@pytest.mark.parametrize("case_id", same_worker(CASES))
def test_import_matches_fla(case_id, fla_oracle, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_cache) = fla_case(case_id, fla_oracle, tmp_path_factory)
    model, state = fla_oracle.import_vs_fla(folder, prompt, steps, ref_prefill, ref_decode, MAX_ABS)
    o = model.blocks[0].attn.o
    for layer, cache in enumerate(ref_cache):
        S = cache["recurrent_state"]  # fla: Gated DeltaNet [B, HV, V, K] (value first), DeltaNet [B, H, K, V]
        if o.gated:
            S = S.transpose(-1, -2)
        got = state[f"{layer}.S"]
        assert got.shape == S.shape == (BATCH, o.num_v_heads, o.head_k_dim, o.head_v_dim), f"{layer}.S: {tuple(got.shape)}"
        assert rel(got, S) <= STATE_REL, f"{layer}.S: relative L2 {rel(got, S):.2e}"
        expected = {"S"} | ({"conv_q", "conv_k", "conv_v"} if o.short_conv else set())
        assert {k.split(".", 1)[1] for k in state if k.startswith(f"{layer}.")} == expected
        for name, window in zip(("conv_q", "conv_k", "conv_v"), cache["conv_state"] or ()):
            got = state[f"{layer}.{name}"]
            assert got.shape == window.shape and rel(got, window) <= STATE_REL, f"{layer}.{name}"


@pytest.mark.slow  # an export with the delta rule's scan: ~1 min each on a loaded 2-core machine
@pytest.mark.parametrize("case_id", same_worker(EXPORTED))
def test_export_matches_fla(case_id, fla_oracle, tmp_path_factory):
    """The two ONNX graphs in ONNX Runtime, driven from the manifest alone, against fla; no Loop or Scan in
    them; then edgelin's validate of the export against the checkpoint passes."""
    import onnx

    out = tmp_path_factory.mktemp(f"{case_id}-export") / "export"
    fla_oracle.export_matches_fla(fla_case(case_id, fla_oracle, tmp_path_factory), CASES[case_id][0], out, MAX_ABS)
    for file in Manifest.load(out).graphs.values():
        ops = {node.op_type for node in onnx.load(str(out / file), load_external_data=False).graph.node}
        assert not {"Loop", "Scan", "If"} & ops, file


# ---- reading the checkpoints (fla builds them; none of its kernels run) ------------------------------------------


@pytest.fixture(scope="module")
def bases(fla_oracle, tmp_path_factory):
    root = tmp_path_factory.mktemp("delta-bases")
    return {
        "delta_net": fla_oracle.build(root / "delta_net", model_type="delta_net"),
        "gated_deltanet": fla_oracle.build(root / "gdn", model_type="gated_deltanet", **SMALL, num_heads=2, num_v_heads=4),
    }


def test_registry_lists_the_delta_families():
    assert {"delta_net", "gated_deltanet"} <= set(IMPORTERS)


@pytest.mark.parametrize("model_type", ["delta_net", "gated_deltanet"])
def test_loads_as_a_protocol_model_and_its_forms_agree(bases, model_type):
    """The protocol; the state layout (per value head, key-major; fla's conv windows); the chunk form at another
    chunk length, the naive loop and the recurrent step all give one prefill's logits and state (float64)."""
    model = load_checkpoint(bases[model_type])
    assert isinstance(model, ExportableModel)
    check_model(model)
    assert model.model_config()["family"] == f"fla/{model_type}"
    json.dumps(model.model_config())
    specs = {s.key: (s.shape, s.dtype) for s in model.state_specs()}
    if model_type == "gated_deltanet":  # 4 value heads of 16 x 32 (expand_v 2) reading 2 query/key heads
        assert specs["0.S"] == (("batch", 4, 16, 32), "float32") and specs["0.conv_v"] == (("batch", 128, 4), "float32")
        assert specs["0.conv_q"] == (("batch", 32, 4), "float32")
    else:
        assert specs["0.S"] == (("batch", 4, 16, 16), "float32") and specs["0.conv_k"] == (("batch", 64, 4), "float32")
    assert model.state_decays is (model_type == "gated_deltanet")
    model = model.double()
    ids = torch.randint(0, 97, (2, 2 * model.chunk_size + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_state = model(ids, form="naive")
        for form, m in (("chunk", model), ("chunk", model.with_chunk_size(7)), ("recurrent", model)):
            logits, state = m(ids, form=form)
            assert max_abs(logits, ref) <= 1e-10, form
            for key, value in ref_state.items():
                assert max_abs(state[key], value) <= 1e-10, (form, key)


@pytest.mark.parametrize("model_type", ["delta_net", "gated_deltanet"])
def test_prefill_in_pieces_and_token_by_token_agree(bases, model_type):
    """The state carries everything: prefill pieces of 1 (shorter than the conv window), C - 1, C, C + 1 tokens
    from a carried state, and the decode step token by token, all give one prefill's logits and state."""
    model = load_checkpoint(bases[model_type])
    C = model.chunk_size
    ids = torch.randint(0, 97, (2, 3 * C + 1), generator=torch.Generator().manual_seed(2))
    pieces_and_steps_agree(model, ids, (1, C - 1, C, C + 1))


@pytest.mark.parametrize("model_type, field, value, fragment", [
    pytest.param("gated_deltanet", "num_v_heads", 3, "multiple of num_heads (2)", id="gdn-num_v_heads"),
    pytest.param("gated_deltanet", "num_v_heads", 1, "multiple of num_heads (2)", id="gdn-fewer-value-heads"),
    pytest.param("gated_deltanet", "expand_v", 1.03, "must be an integer", id="gdn-expand_v"),
    pytest.param("gated_deltanet", "output_gate_activation", "gelu", "'sigmoid'", id="gdn-gate-activation"),
    pytest.param("gated_deltanet", "attn_mode", "fused_chunk", "'fused_recurrent'", id="gdn-attn_mode"),
    pytest.param("gated_deltanet", "head_dim", 0, "positive integer", id="gdn-head_dim"),
    pytest.param("delta_net", "qk_activation", "gelu", "'identity'", id="delta-qk_activation"),
    pytest.param("delta_net", "qk_norm", "layer", "'sum'", id="delta-qk_norm"),
    pytest.param("delta_net", "use_beta", 1, "true or false", id="delta-use_beta-type"),
    pytest.param("delta_net", "attnres_block_size", 2, "attention residuals", id="delta-attnres"),
    pytest.param("delta_net", "use_rope", True, "unknown", id="delta-unknown-field"),
])
def test_unsupported_option_is_refused_by_name(bases, tmp_path, model_type, field, value, fragment, refused):
    refused(edited_copy(bases[model_type], tmp_path / "ckpt", **{field: value}), repr(field), fragment)


def test_conv_weights_without_use_short_conv_are_refused(bases, tmp_path, refused):
    refused(edited_copy(bases["gated_deltanet"], tmp_path / "ckpt", use_short_conv=False), "unexpected", "q_conv1d.weight")


def test_a_gate_missing_from_the_weights_names_the_tensor(bases, tmp_path, refused):
    refused(edited_copy(bases["delta_net"], tmp_path / "ckpt", use_gate=True), "g_proj.weight")


def test_heads_that_do_not_divide_the_width_are_refused(bases, tmp_path, refused):
    refused(edited_copy(bases["delta_net"], tmp_path / "ckpt", num_heads=3), "'expand_k'", "divisible by num_heads (3)")
