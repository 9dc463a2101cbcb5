"""edgelin's import of Hugging Face transformers RecurrentGemma (Griffin) checkpoints against transformers' own model.

Oracle: testkit/hf_oracle.py with the hooks of testkit/oracles/recurrent_gemma.py (transformers 5.x's
RecurrentGemmaForCausalLM in a subprocess; its recurrent blocks keep their state on the modules, read from there): a
tiny random model, a 150-token prefill then 20 cached decode steps, batch 2. Budget, fp32: max abs logits error
<= 1e-4; the states (RG-LRU h, conv windows, the local attention's keys and values) are compared too.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from edgelin import parity, upstream
from edgelin.checkpoint import load_checkpoint
from edgelin.importers import IMPORTERS, fields
from edgelin.ops.diagonal import blocked_diagonal_scan, chunk_diagonal_scan, naive_diagonal_scan
from testkit import hf_oracle, max_abs
from testkit import rel_l2 as rel  # |got - ref|_2 / |ref|_2
from testkit.stateful import (edited_copy, export_vs_reference, fused_export_vs_reference, import_vs_reference,
                              pieces_and_steps_agree, protocol_and_naive_agree)

pytest.importorskip("transformers", reason="transformers is not installed; pip install -e '.[test]'")

MAX_ABS = 1e-4
STATE_REL = 1e-5
BATCH, PROMPT, STEPS = 2, 150, 20
TINY = {"vocab_size": 97, "hidden_size": 32, "num_attention_heads": 4}
CASES = {
    # recurrent, recurrent, attention (the default block_types); one KV head (MQA), RoPE on half of each head, a window
    # of 24 (shorter than the prompt), tied embeddings, conv of 4 taps, a soft cap of 4 that bends the logits
    "rg-griffin-window-softcap": {**TINY, "intermediate_size": 96, "num_hidden_layers": 3, "num_key_value_heads": 1,
                                  "attention_window_size": 24, "logits_soft_cap": 4.0},
    # attention, recurrent cycled over 3 layers; 2 KV heads, q/k/v biases, RoPE on a quarter of each head with another
    # theta; an RG-LRU wider than hidden (48: 4 blocks of 12), conv of 3 taps, untied head, the default soft cap of 30
    "rg-attn-first-lru48-untied": {**TINY, "intermediate_size": 80, "num_hidden_layers": 3, "num_key_value_heads": 2,
                                   "block_types": ["attention", "recurrent"], "attention_bias": True, "lru_width": 48,
                                   "conv1d_width": 3, "tie_word_embeddings": False, "attention_window_size": 200,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                                                       "partial_rotary_factor": 0.25}},
}
_RESULTS: dict[str, tuple] = {}


def oracle(case_id: str, tmp_path_factory):
    """(checkpoint folder, prompt, steps, transformers' outputs) for one case, once per session."""
    return hf_oracle.cached(_RESULTS, case_id, "recurrent_gemma", CASES[case_id], tmp_path_factory, batch=BATCH, prompt=PROMPT,
                            steps=STEPS, vocab=TINY["vocab_size"])


def test_registry_lists_recurrent_gemma():
    assert "recurrent_gemma" in IMPORTERS


@pytest.mark.parametrize("case_id", list(CASES))
def test_import_matches_transformers(case_id, tmp_path_factory):
    folder, prompt, steps, ref = oracle(case_id, tmp_path_factory)
    model, state = import_vs_reference(folder, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    kinds = []
    for i, block in enumerate(model.blocks):
        kinds.append(block.attn.kind)
        if block.attn.kind == "attention":  # transformers keeps the last W - 1 positions, edgelin the last W
            kept = ref[f"{i}.key"].shape[2]
            assert kept == min(PROMPT + STEPS, block.attn.o.window - 1)
            for name in ("key", "value"):
                assert rel(state[f"{i}.{name}"][:, :, -kept:], ref[f"{i}.{name}"]) <= STATE_REL
        else:  # h [B, R]; the conv window [B, R, W] whose last W - 1 columns are transformers' conv1d_state
            assert rel(state[f"{i}.h"], ref[f"{i}.recurrent"]) <= STATE_REL
            assert rel(state[f"{i}.conv"][:, :, 1:], ref[f"{i}.conv"]) <= STATE_REL
            assert state[f"{i}.pos"].tolist() == [PROMPT + STEPS] * BATCH
    cap = CASES[case_id].get("logits_soft_cap", 30.0)
    assert model.logits_softcap == cap and model.max_positions is None and model.state_decays
    if cap < 30:  # the cap bends the logits: they reach far into tanh's flat part
        assert ref["prefill"].abs().max() > 0.9 * cap
    griffin = case_id.startswith("rg-griffin")
    assert kinds == (["rg_lru", "rg_lru", "attention"] if griffin else ["attention", "rg_lru", "attention"])


def test_protocol_forms_and_pieces(tmp_path_factory):
    """The protocol; the naive forms (the RG-LRU's per-token loop with transformers' reset, attention's per-query loop)
    against the chunk form in float64 at chunk 8 (70 tokens: 9 blocks of 8 steps, the scan over them in 2 chunks);
    prefill in pieces (1 token: shorter than the conv window; C - 1; C + 1) and token by token against one prefill."""
    folder, *_ = oracle("rg-attn-first-lru48-untied", tmp_path_factory)
    model = load_checkpoint(folder).with_chunk_size(8)
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    protocol_and_naive_agree(model, "hf/recurrent_gemma", ids)
    pieces_and_steps_agree(model, ids[:, :17], (1, 7, 9))


def test_the_chunked_scan_is_safe_at_long_range():
    """The chunk forms of h_t = exp(g_t) h_{t-1} + u_t (the prefill graph's blocked one and the scan it runs over its
    blocks) against the per-token loop in float64 and float32, with decays from none to exp(-60) per step over 600
    steps (a cumulative log-decay of ~-18000): finite and equal."""
    gen = torch.Generator().manual_seed(0)
    B, T, D = 2, 600, 5
    g = -torch.rand(B, T, D, generator=gen, dtype=torch.float64) * torch.tensor([0.0, 1e-3, 0.1, 5.0, 60.0], dtype=torch.float64)
    u, h0 = torch.randn(B, T, D, generator=gen, dtype=torch.float64), torch.randn(B, D, generator=gen, dtype=torch.float64)
    ref, ref_last = naive_diagonal_scan(g, u, h0)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        for scan, C in ((chunk_diagonal_scan, 1), (chunk_diagonal_scan, 7), (chunk_diagonal_scan, 64), (blocked_diagonal_scan, 4),
                        (blocked_diagonal_scan, 64)):
            h, last = scan(g.to(dtype), u.to(dtype), h0.to(dtype), chunk_size=C)
            assert torch.isfinite(h).all() and max_abs(h.double(), ref) <= tol * ref.abs().max()
            assert max_abs(last.double(), ref_last) <= tol * ref_last.abs().max()


def exported(tmp_path_factory):
    """(the portable export of the window-24, soft-cap-4 case, its export summary), made once per session."""
    if "export" not in _RESULTS:
        from edgelin.exporters import export

        folder, *_ = oracle("rg-griffin-window-softcap", tmp_path_factory)
        out = tmp_path_factory.mktemp("recurrent-gemma-export") / "export"
        _RESULTS["export"] = out, export(folder, out, check=False).summary()
    return _RESULTS["export"]


@pytest.mark.slow  # one export of a 3-layer hybrid and validate's upstream run
def test_export_matches_transformers(tmp_path_factory):
    from edgelin.validate import validate

    folder, prompt, steps, ref = oracle("rg-griffin-window-softcap", tmp_path_factory)
    out, summary = exported(tmp_path_factory)
    said = re.search(r"([\d,]+) bytes \+ ([\d,]+) bytes per position of context \(([\d,]+) bytes at 4,096", summary)
    fixed, per, at_4096 = (int(n.replace(",", "")) for n in said.groups())
    assert at_4096 == fixed + per * CASES["rg-griffin-window-softcap"]["attention_window_size"], summary  # the cache stops at W
    export_vs_reference(out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")
    report = validate(out, folder, steps=16, long=300, upstream="required")  # and vs transformers itself
    assert report.passed, report.table()


@pytest.mark.slow  # the export above, in node
def test_the_javascript_runtime_runs_the_export(tmp_path_factory, tmp_path):
    """runtime/web/edgelin.mjs in node (onnxruntime-node) runs both graphs against the export's golden outputs."""
    from testkit.node import javascript_check

    out, _ = exported(tmp_path_factory)
    report = javascript_check(out, tmp_path)
    assert report["passed"] and len(report["results"]) == 2, report


@pytest.mark.slow  # a second export
def test_fused_export_matches_transformers(tmp_path_factory):
    """``--ops fused``: each RG-LRU scan as one ONNX Runtime LinearAttention node (a head per channel) and its conv as one
    CausalConvWithState node, in both graphs; both graphs against transformers' logits within the portable budget."""
    folder, prompt, steps, ref = oracle("rg-attn-first-lru48-untied", tmp_path_factory)
    out = tmp_path_factory.mktemp("recurrent-gemma-fused") / "export"
    fused_export_vs_reference(folder, out, prompt, steps, ref["prefill"], ref["decode"], MAX_ABS, against="transformers")


def upstream_comparison(folder, prompt, steps, ref: upstream.Upstream):
    """(the import's prefill logits within the fp32 upstream budget of transformers', where its layers first depart,
    its greedy ids) for ``folder``'s import against transformers' float64 run ``ref`` (edgelin.upstream)."""
    budget = parity.BUDGETS["fp32"]["upstream"]
    model = load_checkpoint(folder)
    prefill, decode, greedy, hidden = upstream.import_outputs(model, prompt, steps, ref.greedy.shape[1])
    where = upstream.first_departure(model, hidden, ref.hidden, budget["rel_l2"])
    pairs = ((prefill, ref.prefill), (decode, ref.decode))
    agrees = all(parity.within(parity.errors(mine, theirs), budget) for mine, theirs in pairs)
    return agrees, where, greedy


def test_a_misread_field_departs_at_its_layer(tmp_path_factory, monkeypatch):
    """transformers' own run (float64, edgelin.upstream) agrees with the import at every layer; the window read as 8
    (an importer bug) departs first at the attention layer, 2."""
    folder, *_ = oracle("rg-griffin-window-softcap", tmp_path_factory)
    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, 97, (2, 40)), rng.integers(0, 97, (2, 4))
    ref = upstream.run(folder, "transformers", prompt, steps, greedy=4)
    agrees, where, greedy = upstream_comparison(folder, prompt, steps, ref)
    assert agrees and where.startswith("every layer's output agrees"), where
    assert greedy.tolist() == ref.greedy.tolist()
    real = fields.Fields.get
    monkeypatch.setattr(fields.Fields, "get", lambda self, name: 8 if name == "attention_window_size" else real(self, name))
    agrees, where, _ = upstream_comparison(folder, prompt, steps, ref)
    assert not agrees and where.startswith("first departs at layer 2 (attention)"), where


@pytest.mark.parametrize("changes, field, fragment", [
    ({"hidden_activation": "gelu"}, "hidden_activation", "'gelu_pytorch_tanh'"),
    ({"block_types": ["recurrent", "mlp"]}, "block_types", "'recurrent' and 'attention'"),
    ({"lru_width": 30}, "lru_width", "multiple of num_attention_heads"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_parameters", "'factor'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_parameters", "'default'"),
    ({"logits_soft_cap": None}, "logits_soft_cap", "positive finite number"),
    ({"sliding_window": 16}, "sliding_window", "disagrees"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "must divide"),
    ({"use_griffin_norm": True}, "use_griffin_norm", "unknown"),
])
def test_unsupported_options_are_refused_by_name(changes, field, fragment, tmp_path_factory, tmp_path, refused):
    folder, *_ = oracle("rg-griffin-window-softcap", tmp_path_factory)
    refused(edited_copy(folder, tmp_path / "ckpt", **changes), repr(field), fragment)


def test_fields_transformers_does_not_read_change_nothing(tmp_path_factory, tmp_path):
    """Initialisation scales, dropout and older configs' embeddings_scale_by_sqrt_dim change nothing in transformers'
    model, so nothing here; the older top-level RoPE fields are read as transformers reads them."""
    folder, prompt, _, ref = oracle("rg-griffin-window-softcap", tmp_path_factory)
    out = edited_copy(folder, tmp_path / "ckpt", w_init_variance_scale=3.0, final_w_init_variance_scale=3.0,
                      attention_dropout=0.5, embeddings_scale_by_sqrt_dim=True, rope_parameters=None, rope_theta=10000.0,
                      partial_rotary_factor=0.5)
    with torch.no_grad():
        assert max_abs(load_checkpoint(out)(prompt)[0], ref["prefill"]) <= MAX_ABS
