"""edgelin's import of flash-linear-attention RetNet and GLA checkpoints against fla's own model.

Same oracle as test_fla_parity.py: a tiny random fla model per case (built and saved with the real package),
fla's real ``fused_recurrent`` kernels in Triton's CPU interpreter over 69 prompt tokens and 12 decode steps
(each family's default case through fla's cache one step at a time, the others in one forward), batch 2; edgelin runs the prefill through its chunked form with the ops' log-decay g (per head for
RetNet, per key feature for GLA) and the decode through its recurrent step. Budget, fp32: max abs logits
error <= 1e-4 at every position. The final states (S, RetNet's position, GLA's conv windows) are compared too.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from edgelin.protocol import ExportableModel, check_model
from testkit.stateful import pieces_and_steps_agree
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2

MAX_ABS = 1e-4
STATE_REL = 1e-5  # S, relative L2
BATCH, PROMPT, STEPS = 2, 69, 12  # past chunk boundaries: GLA's chunk of 32 twice, RetNet's of 64 once (fla in the interpreter costs by the token)


def strong_gates(tensors: dict[str, torch.Tensor]) -> None:
    """GLA gate biases from -400 to +8: per-step log-gates from about -25 (forget at once) to -2e-5 (keep)."""
    for name, t in tensors.items():
        if name.endswith("gk_proj.1.bias"):
            t.copy_(torch.linspace(-400.0, 8.0, t.numel())[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(5))])


CASES = {  # id -> (model_type, fla config options; "edit": a change to the saved tensors)
    "retnet-default": ("retnet", {}),  # fla's defaults end to end (expand_v 2, fused norm+gate kernels)
    "retnet-kv_heads2-expand_k2-swish": ("retnet", {"num_kv_heads": 2, "expand_k": 2.0, "feature_map": "swish"}),
    "retnet-unfused_gate-tied_embeddings": ("retnet", {"fuse_norm": False, "tie_word_embeddings": True}),
    "retnet-no_gate-no_affine-relu": ("retnet", {"use_output_gate": False, "elementwise_affine": False, "feature_map": "relu"}),
    "gla-default": ("gla", {}),  # expand_k 0.5, the low-rank gate, fused norm+gate kernels
    "gla-short_conv-kv_heads2-clamp-relu": (
        "gla", {"use_short_conv": True, "num_kv_heads": 2, "clamp_min": -0.03, "feature_map": "relu"},
    ),
    "gla-expand_k1-expand_v2-sigmoid-no_gate-no_affine-norm_eps": (
        "gla", {
            "expand_k": 1.0, "expand_v": 2.0, "feature_map": "sigmoid", "use_output_gate": False, "elementwise_affine": False,
            "norm_eps": 1e-3,
        },
    ),
    "gla-unfused_gate-conv3-silu-strong_gates": (
        "gla", {"fuse_norm": False, "use_short_conv": True, "conv_size": 3, "feature_map": "silu", "edit": strong_gates},
    ),
}
# Exported: rotary positions in an int64 state with grouped heads; GLA's conv windows, grouped heads and clamp.
EXPORTED = ("retnet-kv_heads2-expand_k2-swish", "gla-short_conv-kv_heads2-clamp-relu")

STEPWISE = ("retnet-default", "gla-default")  # fla's own decode path through its cache; the rest in one forward
_RESULTS: dict[str, tuple] = {}


def same_worker(case_ids):
    """The cases as params; an exported case's import and export tests share one xdist worker (its group), so
    fla's run of it (the slow part: fla's kernels in Triton's interpreter) happens once, not once per worker."""
    return [pytest.param(c, marks=pytest.mark.xdist_group(f"fla-{c}")) if c in EXPORTED else c for c in case_ids]


def fla_case(case_id: str, fla_oracle, tmp_path_factory):
    """(checkpoint folder, prompt, steps, fla's results with its raw cache) for one case, once per session."""
    model_type, options = CASES[case_id]
    return fla_oracle.cached_case(_RESULTS, case_id, model_type, options, tmp_path_factory, batch=BATCH, prompt=PROMPT,
                                  steps=STEPS, fused=not options, stepwise=case_id in STEPWISE)



@pytest.mark.parametrize("case_id", same_worker(CASES))
def test_import_matches_fla(case_id, fla_oracle, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_cache) = fla_case(case_id, fla_oracle, tmp_path_factory)
    model, state = fla_oracle.import_vs_fla(folder, prompt, steps[:, :STEPS], ref_prefill, ref_decode, MAX_ABS)

    o = model.blocks[0].attn.o
    groups = o.num_heads // o.num_kv_heads
    for layer, cache in enumerate(ref_cache):
        S = cache["recurrent_state"]  # fla's state per query head: RetNet [B, H, K, V], GLA [B, H, V, K]
        if o.decay == "fixed":
            expected = {"S", "pos"}
            assert torch.equal(state[f"{layer}.pos"], torch.full((BATCH,), PROMPT + STEPS))
        else:
            S = S.transpose(-1, -2)[:, ::groups]  # [B, Hkv, K, V]: the state of every query head of a group is one
            expected = {"S"} | ({"conv_q", "conv_k", "conv_v"} if o.short_conv else set())
            for name, window in zip(("conv_q", "conv_k", "conv_v"), cache["conv_state"] or ()):
                got = state[f"{layer}.{name}"]
                assert got.shape == window.shape and rel(got, window) <= STATE_REL, f"{layer}.{name}"
        assert {k.split(".", 1)[1] for k in state if k.startswith(f"{layer}.")} == expected
        got = state[f"{layer}.S"]
        assert got.shape == S.shape, f"{layer}.S: {tuple(got.shape)} != {tuple(S.shape)}"
        assert rel(got, S) <= STATE_REL, f"{layer}.S: relative L2 {rel(got, S):.2e}"


@pytest.mark.parametrize("case_id", same_worker(EXPORTED))
def test_export_matches_fla(case_id, fla_oracle, tmp_path_factory):
    """The two ONNX graphs in ONNX Runtime, driven from the manifest alone, against fla; then edgelin's validate
    of the export against the checkpoint passes."""
    out = tmp_path_factory.mktemp(f"{case_id}-export") / "export"
    fla_oracle.export_matches_fla(fla_case(case_id, fla_oracle, tmp_path_factory), CASES[case_id][0], out, MAX_ABS)


# ---- reading the checkpoints (fla builds them; none of its kernels run) ------------------------------------------


@pytest.fixture(scope="module")
def bases(fla_oracle, tmp_path_factory):
    """A valid checkpoint per family, with grouped heads (GLA also with its short convs)."""
    root = tmp_path_factory.mktemp("gated-bases")
    return {
        "retnet": fla_oracle.build(root / "retnet", model_type="retnet", num_kv_heads=2),
        "gla": fla_oracle.build(root / "gla", model_type="gla", num_kv_heads=2, use_short_conv=True),
    }


def edit_config(folder, **changes):
    path = folder / "config.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_registry_lists_the_gated_families():
    assert {"retnet", "gla"} <= set(IMPORTERS)


@pytest.mark.parametrize("model_type", ["retnet", "gla"])
def test_loads_as_a_protocol_model_and_the_chunk_changes_nothing(bases, model_type):
    model = load_checkpoint(bases[model_type])
    assert isinstance(model, ExportableModel)
    check_model(model)
    assert model.model_config()["family"] == f"fla/{model_type}"
    json.dumps(model.model_config())
    specs = {s.key: (s.shape, s.dtype) for s in model.state_specs()}
    if model_type == "retnet":  # per query head (the decay differs per head); the rotary position
        assert specs["0.S"] == (("batch", 4, 16, 32), "float32") and specs["0.pos"] == (("batch",), "int64")
    else:  # per key/value head; fla's conv windows [B, D, W]
        assert specs["0.S"] == (("batch", 2, 8, 16), "float32") and specs["0.conv_k"] == (("batch", 16, 4), "float32")
        assert model.chunk_size == 32
    ids = torch.randint(0, 97, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, ref_state = model(ids)
        logits, state = model.with_chunk_size(7)(ids)
        assert (logits - ref).abs().max() <= 1e-5
        for key, value in ref_state.items():
            assert torch.allclose(state[key], value, rtol=1e-5, atol=1e-6), key


@pytest.mark.parametrize("model_type", ["retnet", "gla"])
def test_prefill_in_pieces_and_token_by_token_agree(bases, model_type):
    """The state carries everything: prefill pieces of 1 (shorter than the conv window), C - 1, C, C + 1 tokens
    from a carried state, and the decode step token by token, all give one prefill's logits and state."""
    model = load_checkpoint(bases[model_type])
    C = model.chunk_size
    ids = torch.randint(0, 97, (2, 3 * C + 1), generator=torch.Generator().manual_seed(2))
    pieces_and_steps_agree(model, ids, (1, C - 1, C, C + 1))


def test_retnet_ignores_use_short_conv_as_fla_does(fla_oracle, tmp_path):
    """fla's RetNet model does not pass use_short_conv to its layer: no conv weights, the same model."""
    folder = fla_oracle.build(tmp_path / "ckpt", model_type="retnet", use_short_conv=True)
    assert not any("conv" in name for name in load_file(folder / "model.safetensors"))
    assert not any("conv" in key for key in load_checkpoint(folder).state_dict())


@pytest.mark.parametrize("model_type, field, value, fragment", [
    pytest.param("retnet", "feature_map", "gelu", "'relu'", id="retnet-feature_map"),
    pytest.param("gla", "feature_map", "sqrelu", "'relu'", id="gla-feature_map"),
    pytest.param("retnet", "expand_k", 0.5625, "even", id="retnet-odd-rotary-width"),
    pytest.param("gla", "expand_v", 0.3, "integer", id="gla-expand_v"),
    pytest.param("gla", "clamp_min", 0.5, "negative", id="gla-clamp_min"),
    pytest.param("gla", "use_short_conv", "yes", "true or false", id="gla-use_short_conv-type"),
    pytest.param("gla", "hidden_act", "sigmoid", "'swish'", id="gla-hidden_act"),
    pytest.param("retnet", "attnres_block_size", 2, "attention residuals", id="retnet-attnres"),
    pytest.param("gla", "gate_logit_normalizer", 8, "unknown", id="gla-unknown-field"),
])
def test_unsupported_option_is_refused_by_name(bases, tmp_path, model_type, field, value, fragment, refused):
    ckpt = shutil.copytree(bases[model_type], tmp_path / "ckpt")
    edit_config(ckpt, **{field: value})
    refused(ckpt, repr(field), fragment)


def test_conv_weights_without_use_short_conv_are_refused(bases, tmp_path, refused):
    ckpt = shutil.copytree(bases["gla"], tmp_path / "ckpt")
    edit_config(ckpt, use_short_conv=False)
    refused(ckpt, "unexpected", "q_conv1d.weight")


def test_conv_size_that_disagrees_with_the_weights_names_the_tensor(bases, tmp_path, refused):
    ckpt = shutil.copytree(bases["gla"], tmp_path / "ckpt")
    edit_config(ckpt, conv_size=3)
    refused(ckpt, "conv1d.weight", ", 1, 4)", ", 1, 3)")
