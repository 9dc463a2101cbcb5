"""edgelin's import of flash-linear-attention RWKV-7 checkpoints (RWKV7ForCausalLM) against fla's own model.

The oracle: a tiny random fla RWKV-7 per case (built and saved with the real package) run by fla itself in Triton's
interpreter, batch 2, 69 prompt tokens and 12 more, in one causal forward (each step's logits read at its position;
fla's own cached decode is what validate's upstream run drives in the export test). fla's RWKV7Attention calls its
chunk kernel for 64 tokens or more whatever attn_mode says, and that kernel fails in the interpreter: it is replaced
by fla's own ``fused_recurrent_rwkv7`` kernel (the same DPLR recurrence token by token; edgelin.upstream_run's
``rwkv7_recurrent``, which validate's upstream run applies too). Every other kernel (token shift, the fused addcmul,
the k update, the output correction, the L2 / layer / group norms under fuse_norm) is fla's own. edgelin runs the
prefill through the DPLR chunk form and the decode through its step. Budget, fp32: max abs logits <= 1e-4 at every
position; the final states (S, both token shifts) are compared with fla's cache.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.node import javascript_check
from testkit.stateful import edited_copy, export_vs_reference, pieces_and_steps_agree, protocol_and_naive_agree

MAX_ABS = 1e-4
STATE_REL = 1e-5  # S and the token shifts, relative L2
BATCH, PROMPT, STEPS = 2, 69, 12  # a chunk of 64 and 5 more (fla in the interpreter costs by the token)
SMALL = {"head_dim": 16, "decay_low_rank_dim": 8, "gate_low_rank_dim": 16, "a_low_rank_dim": 8, "v_low_rank_dim": 8}


def strong(tensors: dict[str, torch.Tensor]) -> None:
    """Decays and learning rates at their ends: the w and a LoRAs' biases set to -8 ... 8 across channels, so
    sigmoid(.) spans 3e-4 ... 1: log-decays w from -2e-4 (keep) to -0.6065 (fla's floor), and in-context learning
    rates a from 3e-4 to 1 (the full removal along kk)."""
    for name, t in tensors.items():
        if name.endswith(("w_lora.lora.2.bias", "a_lora.lora.2.bias")):
            t.copy_(torch.linspace(-8.0, 8.0, t.numel())[torch.randperm(t.numel(), generator=torch.Generator().manual_seed(3))])


CASES = {  # id -> fla config options ("edit": a change to the saved tensors)
    # fla's defaults: fuse_norm (its L2 norm's eps for kk), the embeddings' LayerNorm (norm_first), LayerNorms with biases
    "rwkv7-default": {**SMALL},
    # no pre_norm, LayerNorms without bias, torch's F.normalize for kk; heads from num_heads (head_dim null: 2 heads
    # of 32); fla's default LoRA rank for the decay (null: 32); the channel mix's width from hidden_ratio (64 * 3
    # rounded up to 32s); tied embeddings; strong decays and learning rates
    "rwkv7-no_pre_norm-no_bias-torch_l2-heads-ratio-tied-strong": {
        **SMALL, "head_dim": None, "num_heads": 2, "norm_first": False, "norm_bias": False,
        "fuse_norm": False, "decay_low_rank_dim": None, "intermediate_size": None, "hidden_ratio": 3,
        "tie_word_embeddings": True, "edit": strong,
    },
}
EXPORTED = "rwkv7-default"
_RESULTS: dict[str, tuple] = {}


def fla_case(case_id: str, fla_oracle, tmp_path_factory):
    """(checkpoint folder, prompt, steps, fla's results with its raw cache) for one case, once per session."""
    from edgelin.upstream_run import rwkv7_recurrent

    rwkv7_recurrent()
    return fla_oracle.cached_case(_RESULTS, case_id, "rwkv7", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                                  steps=STEPS, fused=True, stepwise=False)


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=pytest.mark.xdist_group("fla-rwkv7")) for c in CASES])
def test_import_matches_fla(case_id, fla_oracle, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_cache) = fla_case(case_id, fla_oracle, tmp_path_factory)
    model, state = fla_oracle.import_vs_fla(folder, prompt, steps, ref_prefill, ref_decode, MAX_ABS)
    o = model.blocks[0].attn.o
    for layer, cache in enumerate(ref_cache):
        assert {k.split(".", 1)[1] for k in state if k.startswith(f"{layer}.")} == {"S", "shift", "ffn.shift"}
        S = cache["recurrent_state"]  # fla's cache: [B, H, K, V], key-major (fla's ops' layout)
        got = state[f"{layer}.S"]
        assert got.shape == S.shape == (BATCH, o.num_heads, o.head_dim, o.value_dim // o.num_heads), f"{layer}.S"
        assert rel(got, S) <= STATE_REL, f"{layer}.S: relative L2 {rel(got, S):.2e}"
        for name, fla_name in (("shift", "conv_state"), ("ffn.shift", "ffn_state")):
            got, ref = state[f"{layer}.{name}"], cache[fla_name]
            assert got.shape == ref.shape == (BATCH, o.hidden_size) and rel(got, ref) <= STATE_REL, f"{layer}.{name}"


@pytest.mark.slow  # an export with the DPLR scan, validate against fla in Triton's interpreter
@pytest.mark.xdist_group("fla-rwkv7")
def test_export_matches_fla(fla_oracle, tmp_path_factory, tmp_path):
    """Both ONNX graphs, driven from the manifest alone, against fla; no Loop, Scan or If in them; edgelin's validate
    against the checkpoint passes with fla's own model run (its cached decode, upstream="required"); the JavaScript
    runtime in node matches the export's golden outputs."""
    import onnx

    from edgelin.exporters import export
    from edgelin.runtime.manifest import Manifest
    from edgelin.validate import validate

    folder, prompt, steps, (ref_prefill, ref_decode, _) = fla_case(EXPORTED, fla_oracle, tmp_path_factory)
    out = tmp_path_factory.mktemp("rwkv7-export") / "export"
    export(folder, out, check=False, max_sequence=fla_oracle.SCAN_BOUND)
    manifest = Manifest.load(out)
    assert manifest.model["family"] == "fla/rwkv7" and manifest.model["source_config"]["model_type"] == "rwkv7"
    for file in manifest.graphs.values():
        ops = {node.op_type for node in onnx.load(str(out / file), load_external_data=False).graph.node}
        assert not {"Loop", "Scan", "If"} & ops, file
    export_vs_reference(out, prompt, steps, ref_prefill, ref_decode, MAX_ABS, against="fla")
    report = validate(out, folder, steps=8, long=300, upstream="required")
    assert report.passed, report.table()
    assert "fused_recurrent_rwkv7" in report.upstream["how"], report.upstream  # the report says how fla ran
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report


# ---- the import's own forms and state (fla builds the checkpoint; none of its kernels run) ----------------------


@pytest.fixture(scope="module")
def base(fla_oracle, tmp_path_factory):
    """fla's defaults at the tiny sizes, with ``strong`` decays and learning rates."""
    from safetensors.torch import load_file, save_file

    folder = fla_oracle.build(tmp_path_factory.mktemp("rwkv7-base") / "ckpt", model_type="rwkv7", **SMALL)
    tensors = load_file(folder / "model.safetensors")
    strong(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_registry_lists_rwkv7():
    assert "rwkv7" in IMPORTERS


def test_protocol_state_layout_and_naive_form(base):
    """The protocol; the state layout (S per head [K, V]; the time mix's and the channel mix's token shifts); the
    chunk form at its chunk and at another, the recurrent loop and the naive DPLR loop give one prefill's logits and
    state in float64 (2 chunks and 1 token; decays and learning rates at their ends, ``strong``)."""
    model = load_checkpoint(base)
    specs = {s.key: (s.shape, s.dtype) for s in model.state_specs()}
    assert specs == {
        f"{i}.{name}": shape for i in range(2) for name, shape in (
            ("S", (("batch", 4, 16, 16), "float32")), ("shift", (("batch", 64), "float32")),
            ("ffn.shift", (("batch", 64), "float32")),
        )
    }
    assert model.accepts_lengths and not model.state_decays
    ids = torch.randint(0, 97, (2, 2 * model.chunk_size + 1), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "fla/rwkv7", ids)
    model = model.double()
    with torch.no_grad():
        ref, ref_state = model(ids, form="naive")
        for form, m in (("chunk", model.with_chunk_size(7)), ("recurrent", model)):
            logits, state = m(ids, form=form)
            assert (logits - ref).abs().max() <= 1e-10, form
            for key, value in ref_state.items():
                assert (state[key] - value).abs().max() <= 1e-10, (form, key)


def test_prefill_in_pieces_and_token_by_token_agree(base):
    """The state carries everything: pieces of 1, C - 1, C, C + 1 tokens from a carried state, and the decode step
    token by token, give one prefill's logits and state."""
    model = load_checkpoint(base)
    C = model.chunk_size
    ids = torch.randint(0, 97, (2, 3 * C + 1), generator=torch.Generator().manual_seed(2))
    pieces_and_steps_agree(model, ids, (1, C - 1, C, C + 1))


def test_a_ragged_batch_gives_each_rows_own_state(base):
    """lengths: a right-padded row's logits and state (S, both token shifts) are those of the row alone."""
    model = load_checkpoint(base)
    ids = torch.randint(0, 97, (2, 37), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([37, 20])
    with torch.no_grad():
        logits, state = model(ids, lengths=lengths)
        alone, alone_state = model(ids[1:, :20])
    assert (logits[1:, :20] - alone).abs().max() <= 1e-5
    for key, value in alone_state.items():
        assert torch.allclose(state[key][1:], value, rtol=1e-5, atol=1e-6), key


@pytest.mark.parametrize("field, value, fragment", [
    pytest.param("hidden_act", "swish", "'sqrelu'", id="hidden_act"),
    pytest.param("value_dim", [64, 128], "as wide as hidden_size (64)", id="value_dim-per-layer"),
    pytest.param("value_dim", 128, "as wide as hidden_size (64)", id="value_dim"),
    pytest.param("value_dim", "wide", "must be a positive integer", id="value_dim-type"),
    pytest.param("head_dim", 24, "does not divide hidden_size (64)", id="head_dim"),
    pytest.param("attn", {"layers": [1], "num_heads": 4}, "hybrid", id="attn"),
    pytest.param("attn_mode", "fused_chunk", "'fused_recurrent'", id="attn_mode"),
    pytest.param("norm_first", 1, "true or false", id="norm_first-type"),
    pytest.param("attnres_block_size", 2, "attention residuals", id="attnres"),
    pytest.param("use_short_conv", True, "unknown", id="unknown-field"),
])
def test_unsupported_option_is_refused_by_name(base, tmp_path, field, value, fragment, refused):
    refused(edited_copy(base, tmp_path / "ckpt", **{field: value}), repr(field), fragment)


def test_the_embeddings_norm_missing_from_the_weights_is_named(base, tmp_path, refused):
    """norm_first=False with the checkpoint's pre_norm present: the tensor is named as unexpected."""
    refused(edited_copy(base, tmp_path / "ckpt", norm_first=False), "unexpected", "pre_norm")
