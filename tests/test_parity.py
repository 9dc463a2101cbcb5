"""edgelin.parity: the one table of budgets and the one error measure; docs/parity.md's table is that table."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from edgelin.parity import (BUDGETS, KIND_BOUNDS, Errors, ParityError, agreement, budget, compare, errors, held, overrides_of,
                            parse_override, with_overrides, within)

PARITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "parity.md"


def _doc_fp32_rows() -> dict[str, tuple[str, str]]:
    text = PARITY_DOC.read_text(encoding="utf-8")
    section = text[text.index("## Parity budgets"):]
    section = section[: section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and not set(cells[1]) <= {"-"}:
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def _num(cell: str) -> float:
    return float(re.match(r"[0-9.e+-]+", cell).group(0))


def test_docs_budget_table_is_the_code_table():
    rows = _doc_fp32_rows()
    fp32 = BUDGETS["fp32"]
    by_kind = {"logits": "logits", "recurrent state": "state", "one provider": "provider", "long decode": "long",
               "the checkpoint's own framework": "upstream"}
    seen = set()
    for label, (max_rel, rel) in rows.items():
        kind = next((k for prefix, k in by_kind.items() if label.startswith(prefix)), None)
        if kind is None:
            continue
        seen.add(kind)
        assert _num(rel) == fp32[kind]["rel_l2"], label
        assert "max_abs" not in fp32[kind], "edgelin's budgets scale with the logits: max_rel, not max_abs"
        if "max_rel" in fp32[kind]:
            assert _num(max_rel) == fp32[kind]["max_rel"], label
        else:
            assert max_rel == "—", label
    assert seen == set(by_kind.values())
    greedy = next(v for k, v in rows.items() if k.startswith("greedy"))
    assert f"≥ {fp32['top1']['min_agreement'] * 100:g} %" in greedy[1]


def test_errors_measure_max_abs_and_relative_l2():
    ref = np.array([3.0, 4.0])
    e = errors(np.array([3.0, 4.5]), ref)
    assert e.max_abs == pytest.approx(0.5) and e.rel_l2 == pytest.approx(0.5 / 5.0) and e.nonfinite == 0
    assert e.max_rel == pytest.approx(0.5 / 4.0)


@pytest.mark.parametrize("shape", [(3, 7, 50), (5, 40), (1, 2, 3, 33)])
def test_errors_of_a_large_array_in_pieces_equal_those_of_the_whole(shape, monkeypatch):
    """Above PIECE values, errors works through whole rows a piece at a time: the same max abs, max rel and nonfinite
    count as the whole array in one go, rel L2 to float64 rounding; a non-finite value anywhere is still infinite."""
    from edgelin import parity

    rng = np.random.default_rng(len(shape))
    ref = (rng.standard_normal(shape) * 7).astype(np.float32)
    got = ref + (rng.standard_normal(shape) * 1e-3).astype(np.float32)
    whole = errors(got, ref)
    monkeypatch.setattr(parity, "PIECE", 2 * shape[-1] + 1)  # two or three rows a piece, the last piece shorter
    pieces = errors(got, ref)
    assert (pieces.max_abs, pieces.max_rel, pieces.nonfinite) == (whole.max_abs, whole.max_rel, whole.nonfinite)
    assert pieces.rel_l2 == pytest.approx(whole.rel_l2, rel=1e-12)
    got.reshape(-1)[-1] = np.nan
    e = errors(got, ref)
    assert e.max_abs == e.rel_l2 == math.inf and e.nonfinite == 1


def test_max_rel_is_on_the_scale_of_the_reference_and_absolute_below_one():
    """The same relative error on logits 100x larger is the same max_rel (and 100x the max abs); logits
    below 1 are held to the max abs itself (no blow-up for a reference near zero)."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 50)) * 5
    got = ref + rng.standard_normal(ref.shape) * 1e-5
    small, large = errors(got, ref), errors(got * 100, ref * 100)
    assert large.max_rel == pytest.approx(small.max_rel) and large.max_abs == pytest.approx(100 * small.max_abs)
    assert small.max_rel == pytest.approx(small.max_abs / np.abs(ref).max())
    tiny = errors(np.array([1e-6, 2e-6]), np.array([0.0, 1e-9]))
    assert tiny.max_rel == tiny.max_abs == pytest.approx(2e-6 - 1e-9)
    assert errors(np.zeros(2), np.ones(3)).max_rel == math.inf


def test_a_max_rel_bound_needs_a_measured_max_rel():
    assert within(Errors(1e-6, 1e-7, 0, 1e-7), {"max_rel": 1e-5})
    assert not within(Errors(1e-6, 1e-7, 0, 2e-5), {"max_rel": 1e-5})
    assert not within(Errors(1e-6, 1e-7), {"max_rel": 1e-5})  # not measured: never within
    assert within(Errors(1e-6, 1e-7), {"max_abs": 1e-5})
    assert Errors(1, 1, 0, 0.5).worst(Errors(2, 0.5, 1, 0.25)) == Errors(2, 1, 1, 0.5)


def test_the_budget_table_uses_the_scaled_bounds():
    for precision, table in BUDGETS.items():
        for kind in ("logits", "provider", "long", "upstream"):
            assert set(table[kind]) == {"max_rel", "rel_l2"}, (precision, kind)
        for kind, bounds in table.items():
            assert set(bounds) <= set(KIND_BOUNDS[kind]), (precision, kind)


def test_overrides_parse_apply_and_never_change_the_table():
    assert parse_override("logits.max_rel=3e-5") == ("logits", "max_rel", 3e-5)
    assert parse_override(" heldout.max_bpb_delta = 0.01") == ("heldout", "max_bpb_delta", 0.01)
    assert overrides_of(["logits.max_rel=1", "logits.max_rel=2", "top1.min_agreement=0.5"]) == {
        "logits": {"max_rel": 2.0}, "top1": {"min_agreement": 0.5}}
    before = {p: {k: dict(v) for k, v in t.items()} for p, t in BUDGETS.items()}
    out = with_overrides(BUDGETS["int8"], {"logits": {"max_rel": 0.01, "max_abs": 3.0}})
    assert out["logits"] == {"max_rel": 0.01, "rel_l2": BUDGETS["int8"]["logits"]["rel_l2"], "max_abs": 3.0}
    assert BUDGETS == before
    budgets, merged = held("fp16", {"logits": {"max_rel": 1.0}, "top1": {"min_agreement": 0.1}}, {"logits": {"max_rel": 2.0}})
    assert merged == {"logits": {"max_rel": 2.0}, "top1": {"min_agreement": 0.1}} and budgets["logits"]["max_rel"] == 2.0
    assert held("fp32") == (with_overrides(BUDGETS["fp32"], {}), {})


@pytest.mark.parametrize(("text", "message"), [
    ("logits", "write KIND.BOUND=VALUE"), ("logits.max_rel", "write KIND.BOUND=VALUE"), ("vibes.max_rel=1", "no comparison kind"),
    ("logits.agreement=1", "no bound 'agreement'"), ("state.max_rel=1", "state has no bound 'max_rel'"),
    ("logits.max_rel=x", "'x' is not a number"), ("logits.max_rel=nan", "finite number"), ("logits.max_rel=-1e-5", ">= 0"),
    ("greedy.min_agreement=1.01", "<= 1"),
])
def test_bad_overrides_are_refused_by_name(text, message):
    with pytest.raises(ParityError, match=message):
        parse_override(text)


def test_bad_override_mappings_are_refused():
    with pytest.raises(ParityError, match="no comparison kind 'vibes'"):
        with_overrides(BUDGETS["fp32"], {"vibes": {"max_rel": 1.0}})
    with pytest.raises(ParityError, match="logits has no bound 'min_agreement'"):
        held("fp32", {"logits": {"min_agreement": 1.0}})
    with pytest.raises(ParityError, match="must be a number"):
        with_overrides(BUDGETS["fp32"], {"logits": {"max_rel": "1e-5"}})
    with pytest.raises(ParityError, match="must map bounds"):
        with_overrides(BUDGETS["fp32"], {"logits": 1e-5})
    with pytest.raises(ParityError, match="known: fp32"):
        held("fp8")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_is_never_within_any_budget(bad):
    e = errors(np.array([1.0, bad], np.float32), np.array([1.0, 1.0], np.float32))
    assert e.nonfinite == 1 and math.isinf(e.max_abs)
    assert not within(e, {})  # not even an empty (unbounded) budget


def test_shape_mismatch_and_integer_states():
    assert math.isinf(errors(np.zeros(3), np.zeros(4)).max_abs)
    assert errors(np.array([1, 2]), np.array([1, 2])) == Errors(0.0, 0.0, 0, 0.0)
    assert math.isinf(errors(np.array([1, 2]), np.array([1, 3])).rel_l2)


def test_within_checks_every_bound():
    assert within(Errors(1e-5, 1e-6), {"max_abs": 1e-4, "rel_l2": 1e-5})
    assert not within(Errors(2e-4, 1e-6), {"max_abs": 1e-4, "rel_l2": 1e-5})
    assert not within(Errors(1e-5, 2e-5), {"max_abs": 1e-4, "rel_l2": 1e-5})


def test_compare_pairs_by_name_and_reports_every_pair():
    ref = {"a": np.ones(3), "b": np.ones(2), "c": np.ones(1)}
    got = {"b": np.ones(2) * 2, "a": np.ones(3)}
    out = {c.name: c.passed for c in compare(got, ref, {"max_abs": 1e-3})}
    assert out == {"a": True, "b": False, "c": False}


def test_agreement_never_counts_nan_logits():
    ref = np.array([[0.0, 1.0], [1.0, 0.0]])
    assert agreement(ref, ref) == 1.0
    assert agreement(np.full_like(ref, np.nan), ref) == 0.0


def test_unknown_precision_or_kind_is_a_typed_error():
    with pytest.raises(ParityError, match="known: fp32"):
        budget("fp8", "logits")
    with pytest.raises(ParityError, match="kinds: logits"):
        budget("fp32", "vibes")
