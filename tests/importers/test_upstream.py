"""validate's upstream group: the checkpoint's own framework (transformers, fla) against edgelin's import and graphs.

Per family, one tiny random checkpoint, run once by its framework through edgelin.upstream (a subprocess: fla's
kernels in Triton's interpreter, transformers with triton and fla hidden). edgelin's import of it must agree within
the fp32 upstream budget -- prefill logits, cached decode logits, every layer's output, greedy ids; and a deliberately
wrong import (one config field misread, as an importer bug would misread it) must fail the comparison and name the
first layer where it departs. The end-to-end tests export a wrong import: today's checks (graphs vs the import)
pass it, the upstream group fails it, naming the layer; the correct export passes the whole validate, from the CLI too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgelin import parity, upstream
from edgelin.checkpoint import load_checkpoint
from edgelin.errors import EdgelinError
from edgelin.importers import FRAMEWORKS, IMPORTERS, fields
from testkit import hf_oracle

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

PROMPT, STEPS = 69, 8  # a chunk of 64 and 5 more, as validate's own prompt
FP32 = parity.BUDGETS["fp32"]["upstream"]

HF_TINY_QWEN = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "num_hidden_layers": 4,
}
MAMBA = {"vocab_size": 97, "hidden_size": 32, "state_size": 8, "num_hidden_layers": 2, "expand": 2}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # special tokens inside the tiny vocabulary


def misread(field: str, value):
    """A wrong import: the config field ``field`` read as ``value`` (patch the importers' shared field reads)."""
    def apply(monkeypatch):
        real = fields.Fields.get
        monkeypatch.setattr(fields.Fields, "get", lambda self, name: value if name == field else real(self, name))
    return apply


def rope_misread(module: str, how):
    """A wrong import: the family's RoPE reading altered by ``how((theta, rotary), head_dim)``."""
    def apply(monkeypatch):
        import importlib

        mod = importlib.import_module(module)
        real = mod.read_rope
        monkeypatch.setattr(mod, "read_rope", lambda f, head_dim, **kw: how(real(f, head_dim, **kw), head_dim))
    return apply


def ba_swapped(monkeypatch):
    """A wrong import: Qwen3-Next's in_proj_ba unpacked with its b rows and a rows exchanged."""
    from edgelin.importers.hf import qwen3_next
    from edgelin.importers.weights import RowSplit

    real = qwen3_next.fused_splits

    def swapped(f):
        qkvz, ba = real(f)
        (b_name, b_rows), (a_name, a_rows) = ba.parts
        return qkvz, RowSplit(ba.suffix, ((b_name, a_rows), (a_name, b_rows)))
    monkeypatch.setattr(qwen3_next, "fused_splits", swapped)


# id -> (framework, model_type, config / fla options, a wrong import, the layer where it first departs)
CASES = {
    # a partial rotary width taken as full: the first attention layer (3) departs
    "qwen3_5": ("transformers", "qwen3_5_text", HF_TINY_QWEN,
                rope_misread("edgelin.importers.hf.qwen_hybrid", lambda r, d: (r[0], d)), "layer 3 (attention)"),
    # Qwen3-Next's fused in_proj_ba read with b and a swapped: the first Gated DeltaNet layer departs
    "qwen3_next": ("transformers", "qwen3_next", {**HF_TINY_QWEN, "num_experts": 0}, ba_swapped, "layer 0"),
    # conv, attention, conv, attention: rope_theta read 10x too large departs at layer 1
    "lfm2": ("transformers", "lfm2", {"vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "block_multiple_of": 32, "intermediate_size": 192, "num_hidden_layers": 4,
                                      "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
             rope_misread("edgelin.importers.hf.lfm2", lambda r, d: (10 * r[0], r[1])), "layer 1 (attention)"),
    # the gated norm's and the blocks' epsilon misread: the first layer departs
    "mamba2": ("transformers", "mamba2", {**MAMBA, "num_heads": 8, "head_dim": 8, "n_groups": 2, "conv_kernel": 4},
               misread("layer_norm_epsilon", 0.5), "layer 0"),
    "bamba": ("transformers", "bamba", {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_expand": 2}, rope_misread("edgelin.importers.hf.bamba", lambda r, d: (10 * r[0], r[1])),
        "layer 1 (attention)"),
    # the softmax scale attention_multiplier (0.2) read as its default 1
    "granitemoehybrid": ("transformers", "granitemoehybrid", {
        "vocab_size": 97, "hidden_size": 32, "shared_intermediate_size": 40, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 0, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 8,
        "mamba_d_conv": 4, "mamba_expand": 2, "layer_types": ["mamba", "attention", "mamba"], "position_embedding_type": "rope",
        "attention_multiplier": 0.2}, misread("attention_multiplier", 1.0), "layer 1 (attention)"),
    # Nemotron-H: Mamba2, attention, MLP; its dt clamp (time_step_min) read as 0.5: the first (Mamba2) layer departs
    "nemotron_h": ("transformers", "nemotron_h", {
        "vocab_size": 97, "hidden_size": 32, "hybrid_override_pattern": "M*-", "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 40, "mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2,
        "conv_kernel": 4, "time_step_min": 1e-5}, misread("time_step_min", 0.5), "layer 0 (mamba2)"),
    # fla: the norms' epsilon misread (the first layer departs); the feature map read as another
    "linear_attn": ("fla", "linear_attn", {"feature_map": "elu", "norm_feature_map": True}, misread("feature_map", "relu"), "layer 0"),
    "retnet": ("fla", "retnet", {}, misread("norm_eps", 0.5), "layer 0"),
    "gla": ("fla", "gla", {"use_short_conv": True}, misread("norm_eps", 0.5), "layer 0"),
    "delta_net": ("fla", "delta_net", {}, misread("allow_neg_eigval", True), "layer 0"),
    "gated_deltanet": ("fla", "gated_deltanet", {"head_dim": 16}, misread("norm_eps", 0.5), "layer 0"),
    # KDA (a gate per channel) and Gated DeltaProduct (two Householder steps a token): the gate's and beta's ranges misread
    "kda": ("fla", "kda", {"head_dim": 16}, misread("allow_neg_eigval", True), "layer 0"),
    "gated_deltaproduct": ("fla", "gated_deltaproduct", {"head_dim": 16, "num_householder": 2, "use_forget_gate": True},
                           misread("allow_neg_eigval", True), "layer 0"),
    # RWKV-7: its LayerNorms' epsilon misread (the embeddings' norm and layer 0's)
    "rwkv7": ("fla", "rwkv7", {"head_dim": 16, "decay_low_rank_dim": 8, "gate_low_rank_dim": 16, "a_low_rank_dim": 8,
                               "v_low_rank_dim": 8}, misread("norm_eps", 0.5), "layer 0"),
    # Jamba (dense): Mamba-1, attention, Mamba-1; the attention's KV heads read as 4 (of 2): layer 1 departs
    "jamba": ("transformers", "jamba", {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 1, "attn_layer_period": 3, "attn_layer_offset": 1, "mamba_d_state": 8,
        "mamba_d_conv": 3, "mamba_expand": 2}, misread("rms_norm_eps", 0.5), "layer 0 (mamba)"),
    "mamba": ("transformers", "mamba", MAMBA, misread("layer_norm_epsilon", 0.5), "layer 0 (mamba)"),
    # Falcon-Mamba: its weightless dt/B/C norms' epsilon misread
    "falcon_mamba": ("transformers", "falcon_mamba", {**MAMBA, "mixer_rms_eps": 1e-4}, misread("mixer_rms_eps", 0.5), "layer 0 (mamba)"),
    # LFM3: conv, sliding attention (window 40 < the prompt), full attention; the window read one longer
    "lfm3": ("transformers", "lfm3", {
        **IDS, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 16,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "sliding_window": 40,
        "layer_types": ["conv", "sliding_attention", "full_attention"]}, misread("sliding_window", 41), "layer 1 (attention)"),
    # OLMo-hybrid: Gated DeltaNet, post-norm attention, Gated DeltaNet; beta's range (allow_neg_eigval) misread
    "olmo_hybrid": ("transformers", "olmo_hybrid", {
        **IDS, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"], "num_key_value_heads": 2,
        "linear_allow_neg_eigval": True}, misread("linear_allow_neg_eigval", False), "layer 0 (fla/delta)"),
    # Falcon-H1: attention beside Mamba2 in each layer; the Mamba2 norm's order (mamba_norm_before_gate) misread
    "falcon_h1": ("transformers", "falcon_h1", {
        **IDS, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "mamba_d_state": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_rms_norm": True,
        "mamba_norm_before_gate": True}, misread("mamba_norm_before_gate", False), "layer 0 (parallel)"),
    # Zamba2: Mamba2, then two hybrid layers on one shared block; its RoPE (use_mem_rope) read as off
    "zamba2": ("transformers", "zamba2", {
        **IDS, "vocab_size": 97, "hidden_size": 32, "num_attention_heads": 4, "mamba_d_state": 8, "intermediate_size": 40,
        "num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"], "use_mem_rope": True, "n_mamba_heads": 8,
        "mamba_ngroups": 2, "time_step_min": 1e-5}, misread("use_mem_rope", False), "layer 1 (zamba2/hybrid)"),
    # LFM2-MoE: conv, attention (dense), conv with 8 experts top-2; the chosen weights' renormalisation misread as off
    "lfm2_moe": ("transformers", "lfm2_moe", {
        **IDS, "vocab_size": 97, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"],
        "num_dense_layers": 2, "num_experts": 8, "num_experts_per_tok": 2}, misread("norm_topk_prob", False), "layer 2"),
    # Qwen3.5-MoE: Gated DeltaNet, attention, each with 8 experts top-2 and a gated shared expert; the shared width misread
    "qwen3_5_moe_text": ("transformers", "qwen3_5_moe_text", {
        **{k: v for k, v in HF_TINY_QWEN.items() if k != "intermediate_size"}, "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"], "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48},
        misread("num_experts_per_tok", 3), "layer 0"),
    # RecurrentGemma: recurrent, recurrent, local attention (window 24); the window read as 8
    "recurrent_gemma": ("transformers", "recurrent_gemma", {
        **IDS, "vocab_size": 97, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 1, "attention_window_size": 24}, misread("attention_window_size", 8), "layer 2 (attention)"),
}
_RUNS: dict[str, tuple] = {}


def checkpoint(case_id: str, request):
    """(checkpoint folder, prompt, steps, the framework's run) for one case, once per session."""
    if case_id not in _RUNS:
        tmp_path_factory = request.getfixturevalue("tmp_path_factory")
        framework, model_type, options, _, _ = CASES[case_id]
        root = tmp_path_factory.mktemp(f"upstream-{case_id}")
        if framework == "transformers":
            folder, _ = hf_oracle.run(model_type, options, root, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
        else:
            fla_oracle = request.getfixturevalue("fla_oracle")  # fla's own models (skips where fla cannot be imported)
            folder = fla_oracle.build(root / "ckpt", model_type=model_type, **options)
        rng = np.random.default_rng(0)
        prompt, steps = rng.integers(0, 97, (2, PROMPT)), rng.integers(0, 97, (2, STEPS))
        _RUNS[case_id] = folder, prompt, steps, upstream.run(folder, framework, prompt, steps, greedy=8)
    return _RUNS[case_id]


def compare(folder: Path, prompt, steps, ref: upstream.Upstream):
    """(prefill errors, decode errors, where the import first departs, greedy ids of the import) for ``folder``'s import."""
    model = load_checkpoint(folder)
    mine_prefill, mine_decode, greedy, hidden = upstream.import_outputs(model, prompt, steps, ref.greedy.shape[1])
    where = upstream.first_departure(model, hidden, ref.hidden, FP32["rel_l2"])
    return parity.errors(mine_prefill, ref.prefill), parity.errors(mine_decode, ref.decode), where, greedy


def test_every_foreign_family_names_its_framework():
    assert set(FRAMEWORKS) == set(IMPORTERS)
    assert {FRAMEWORKS[c[1]] for c in CASES.values()} == {"transformers", "fla"}
    # the vision-language folders: a test below (qwen3_5) and tests/importers/test_hf_qwen3_5_moe.py (qwen3_5_moe)
    assert {c[1] for c in CASES.values()} | {"qwen3_5", "qwen3_5_moe"} == set(IMPORTERS)


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=pytest.mark.xdist_group(f"upstream-{c}")) for c in CASES])
def test_the_import_agrees_with_its_framework_and_a_misread_field_departs_at_its_layer(case_id, request, monkeypatch):
    """One test per family: the framework's run (the slow part, fla's in Triton's interpreter) is made once."""
    folder, prompt, steps, ref = checkpoint(case_id, request)
    assert ref.prefill.shape == (2, PROMPT, 97) and ref.decode.shape == (STEPS, 2, 97) and ref.greedy.shape == (2, 8)
    e_prefill, e_decode, where, greedy = compare(folder, prompt, steps, ref)
    assert parity.within(e_prefill, FP32) and parity.within(e_decode, FP32), (e_prefill, e_decode)
    assert where.startswith("every layer's output agrees"), where
    assert greedy.tolist() == ref.greedy.tolist()
    assert ref.seconds["total"] > 0 and ref.how
    # the same checkpoint imported wrongly: one config field misread, as an importer bug would
    *_, wrong, layer = CASES[case_id]
    wrong(monkeypatch)
    e_prefill, e_decode, where, _ = compare(folder, prompt, steps, ref)
    assert not parity.within(e_prefill, FP32) and not parity.within(e_decode, FP32), (e_prefill, e_decode)
    assert where.startswith(f"first departs at {layer}"), where


@pytest.mark.xdist_group("upstream-qwen3_5")
def test_a_vision_language_checkpoint_runs_as_transformers_saves_it(request, tmp_path):
    """A qwen3_5 folder as transformers writes it (Qwen3_5ForConditionalGeneration: a vision tower beside the text
    model): transformers runs that class on text ids, and it agrees with edgelin's import of the text model."""
    folder, prompt, steps, ref = checkpoint("qwen3_5", request)
    vl = hf_oracle.vision_language(folder, tmp_path / "vl")
    assert upstream.framework_of(vl) == "transformers"
    got = upstream.run(vl, "transformers", prompt, steps, greedy=8)
    assert got.model_class == "Qwen3_5ForConditionalGeneration"
    assert parity.within(parity.errors(got.prefill, ref.prefill), FP32) and got.greedy.tolist() == ref.greedy.tolist()
    e_prefill, e_decode, where, greedy = compare(vl, prompt, steps, got)
    assert parity.within(e_prefill, FP32) and parity.within(e_decode, FP32), (e_prefill, e_decode)
    assert greedy.tolist() == got.greedy.tolist()


@pytest.mark.xdist_group("upstream-mamba2")
def test_a_framework_that_cannot_load_every_weight_is_refused(request, tmp_path):
    """transformers would run a missing tensor at its random init: the run is refused, naming it."""
    from safetensors.torch import load_file, save_file

    folder, prompt, steps, _ = checkpoint("mamba2", request)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    gone = next(k for k in tensors if k.endswith("norm_f.weight") or k.endswith("norm.weight"))
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(upstream.UpstreamError, match="random init") as info:
        upstream.run(broken, "transformers", prompt, steps, greedy=1)
    assert "\n" not in str(info.value)


def test_modes_and_what_cannot_be_compared(tmp_path, monkeypatch):
    from edgelin.validate.upstream_checks import upstream_plan as _upstream_plan

    with pytest.raises(EdgelinError, match="upstream must be one of off, auto, required"):
        _upstream_plan("sometimes", None)
    assert _upstream_plan("off", None) == (None, "", "")
    assert _upstream_plan("auto", None) == (None, "", "")  # an in-memory model is the model validated: nothing to say
    with pytest.raises(EdgelinError, match="--upstream required: the model was passed in memory"):
        _upstream_plan("required", None)
    from edgelin.models import bundled_checkpoint

    assert _upstream_plan("auto", bundled_checkpoint()) == (None, "", "")
    with pytest.raises(EdgelinError, match="--upstream required: the checkpoint is edgelin's own model"):
        _upstream_plan("required", bundled_checkpoint())
    own = tmp_path / "cfg"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    assert _upstream_plan("auto", own) == ("transformers", "", "float64")
    # the framework missing: said with the command that installs it; "required" refuses before anything runs
    monkeypatch.setattr(upstream.importlib.util, "find_spec", lambda name: None)
    framework, why, _ = _upstream_plan("auto", own)
    assert framework is None and "transformers is not installed" in why and "pip install" in why
    with pytest.raises(EdgelinError, match="--upstream required: transformers is not installed"):
        _upstream_plan("required", own)


def test_the_framework_model_that_cannot_fit_in_memory_is_said_not_run(tmp_path):
    """The framework's own model is planned from the checkpoint's headers against the memory available: float64
    where it fits, float32 (said, with both sizes) where only that fits, not run where neither does ("auto": the
    report says what it needs, what is available and what the graphs were held to instead; "required": refused
    before anything runs)."""
    from safetensors.numpy import save_file

    from edgelin.validate.upstream_checks import upstream_plan as _upstream_plan

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    save_file({"a": np.zeros((1000, 500), np.float32), "b": np.zeros(250_000, np.float16)}, str(folder / "model.safetensors"))
    assert upstream.parameter_count(folder) == 750_000
    need64 = int(750_000 * 8 * upstream.FIT_MARGIN) + upstream.FIT_BASE
    need32 = int(750_000 * 4 * upstream.FIT_MARGIN) + upstream.FIT_BASE
    assert _upstream_plan("required", folder, available=need64) == ("transformers", "", "float64")
    framework, note, dtype = _upstream_plan("auto", folder, available=need64 - 1)
    assert (framework, dtype) == ("transformers", "float32")
    assert note.startswith("run in float32, not float64: in float64 transformers' own model needs about") and "available" in note
    framework, why, dtype = _upstream_plan("auto", folder, available=need32 - 1)
    assert framework is None and dtype == ""
    assert why.startswith("not compared: transformers' own model (0.00 B values) needs about") and "held to edgelin's import" in why
    with pytest.raises(EdgelinError, match="--upstream required: transformers' own model .* needs about .*more memory") as info:
        _upstream_plan("required", folder, available=need32 - 1)
    assert "\n" not in str(info.value)
    # fla's models run in float32 only here: that is their reference, nothing to say
    (folder / "config.json").write_text(json.dumps({"model_type": "linear_attn"}))
    if upstream.framework_of(folder) == "fla" and upstream.unavailable("fla") is None:
        assert _upstream_plan("auto", folder, available=need32) == ("fla", "", "float32")


# ---- end to end: validate on exports ------------------------------------------------------------------------------
E2E = "lfm2"
EDGELIN = str(Path(sys.executable).with_name("edgelin"))  # the console script of this environment


@pytest.mark.xdist_group(f"upstream-{E2E}")
def test_validate_passes_today_but_fails_upstream_on_a_wrong_export(request, tmp_path_factory, monkeypatch):
    """The export of a wrong import is consistent with that import: every check against it passes; the upstream
    group fails, and names the first departing layer."""
    from edgelin.exporters import export
    from edgelin.validate import validate

    folder, *_ = checkpoint(E2E, request)
    CASES[E2E][3](monkeypatch)
    out = tmp_path_factory.mktemp("upstream-wrong") / "export"
    export(folder, out, check=False)
    report = validate(out, folder, steps=8, upstream="required", kv=(1024,))  # LFM2's 16k KV check: test_hf_lfm2.py
    today = [c for c in report.checks if c.group != "upstream"]
    assert today and not any(c.failed for c in today), report.table()
    mine = [c for c in report.checks if c.group == "upstream"]
    assert [c.name.split(":")[0] for c in mine] == ["import vs transformers"] * 2 + ["graphs vs transformers"] * 2 + \
        ["import vs transformers", "graphs vs transformers"]
    prefill = mine[0]
    assert prefill.failed and prefill.where.startswith("first departs at layer 1 (attention)"), prefill.where
    assert mine[1].failed and mine[2].failed and mine[3].failed  # decode through the cache, both graphs
    assert not report.passed
    assert report.upstream["framework"] == "transformers" and report.upstream["model_class"] == "Lfm2ForCausalLM"
    assert "upstream: Lfm2ForCausalLM run by transformers' own PyTorch paths" in report.table()


@pytest.mark.xdist_group(f"upstream-{E2E}")
def test_the_cli_validates_a_correct_export_against_transformers(request, tmp_path_factory, tmp_path):
    from edgelin.exporters import export

    folder, *_ = checkpoint(E2E, request)
    out = tmp_path_factory.mktemp("upstream-right") / "export"
    export(folder, out, check=False)
    report = tmp_path / "report.json"
    # --kv 1024: the KV check through the CLI at one length (LFM2's cache after 16k tokens: test_hf_lfm2.py)
    done = subprocess.run([EDGELIN, "validate", str(out), "--checkpoint", str(folder), "--steps", "8", "--kv", "1024",
                           "--upstream", "required", "--json", str(report)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("upstream")]
    assert len(rows) == 6 + 1, done.stdout  # prefill, decode, greedy: import and graphs each; the line naming the run
    data = json.loads(report.read_text())
    ups = [c for c in data["checks"] if c["group"] == "upstream"]
    assert len(ups) == 6 and all(c["status"] == "pass" for c in ups)
    assert data["upstream"]["decode_steps"] == 8 and data["upstream"]["seconds"]["total"] > 0
    # off: no upstream rows at all (--kv 0: the KV-cache checks are this export's first run's, above, not what is tested)
    done = subprocess.run([EDGELIN, "validate", str(out), "--checkpoint", str(folder), "--steps", "4",
                           "--upstream", "off", "--kv", "0"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and not [line for line in done.stdout.splitlines() if line.startswith("upstream")], done.stdout


@pytest.mark.parametrize("required", [False, True])
def test_the_framework_model_is_planned_again_when_it_runs(required, monkeypatch):
    """validate plans the framework's model at its start and again just before running it (its own session and model
    then hold memory that was free at the start): where it no longer fits, nothing is run and the upstream group says
    so (not applicable, or a failure under --upstream required)."""
    from types import SimpleNamespace

    from edgelin.validate.upstream_checks import against_upstream

    added = []
    v = SimpleNamespace(chunk=4, ids=lambda b, t: np.zeros((b, t), np.int64), add=added.append, say=lambda _m: None)
    monkeypatch.setattr(upstream, "fitting_dtype", lambda *_a, **_k: (None, "transformers' own model needs about 9.9 GB"))
    monkeypatch.setattr(upstream, "run", lambda *_a, **_k: pytest.fail("the framework's model was run"))
    assert against_upstream(v, None, Path("ckpt"), "transformers", 4, 1, required=required, dtype="float64") == {}
    (check,) = added
    assert check.status == ("fail" if required else "n/a"), check.status
    assert check.where.startswith("not run: transformers' own model needs about 9.9 GB, beside validate's own session")
