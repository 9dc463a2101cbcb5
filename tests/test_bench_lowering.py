"""The bench's opt-in ``lowering`` section (edgelin/bench/lowering.py), what can be checked without timing: the
speed-up arithmetic, the table, a JavaScript runtime that is not there. The section itself runs in
``scripts/lowering_bench.py`` (record docs/bench/lowering.json): it exports six models, minutes, not a unit test."""

from __future__ import annotations

from pathlib import Path

from edgelin.bench import harness, lowering
from edgelin.bench.plan import ALL_SECTIONS, OPT_IN_SECTIONS
from edgelin.bench.report import lowering_lines


def test_it_is_an_opt_in_section():
    assert "lowering" in OPT_IN_SECTIONS and "lowering" in ALL_SECTIONS


def test_speedups_invert_times_and_keep_rates():
    medians = {"portable/decode_b1_ms": 2.0, "fused/decode_b1_ms": 1.0, "portable/prefill_1024_tok_s": 100.0,
               "fused/prefill_1024_tok_s": 300.0, "portable/only_one_side_ms": 1.0}
    assert lowering.speedups(medians) == {"decode_b1_ms": 2.0, "prefill_1024_tok_s": 3.0}


def test_a_missing_javascript_runtime_is_said_not_failed(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "ROOT", tmp_path)  # a checkout without node_modules
    got = lowering.js_runtime("onnxruntime-web", {"portable": Path("a"), "fused": Path("b")}, 1, 1, (64,))
    assert got["status"] == "skipped" and "node_modules/onnxruntime-web" in got["reason"]


def test_the_table_names_each_runtime_and_says_what_was_skipped():
    part = {"status": "ok", "models": {"gdn": {
        "nodes_per_layer": {"portable": 53.75, "fused": 47.75},
        "runtimes": {"python": {"portable/decode_b1_ms": 0.4, "fused/decode_b1_ms": 0.2}, "wasm": {"status": "skipped", "reason": "npm ci"}},
        "fused_speedup": {"python": {"decode_b1_ms": 2.0}}}}}
    text = "\n".join(lowering_lines(part))
    assert "portable 53.75, fused 47.75" in text and "python  decode_b1_ms x2.00" in text and "wasm    skipped: npm ci" in text
    assert "skipped: why" in "\n".join(lowering_lines({"status": "skipped", "reason": "why"}))
