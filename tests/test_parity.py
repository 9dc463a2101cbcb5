"""edgelin.parity: the one table of budgets and the one error measure; the README's table is that table."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from edgelin.parity import BUDGETS, Errors, ParityError, agreement, budget, compare, errors, within

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_fp32_rows() -> dict[str, tuple[str, str]]:
    text = README.read_text(encoding="utf-8")
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


def test_readme_budget_table_is_the_code_table():
    rows = _readme_fp32_rows()
    fp32 = BUDGETS["fp32"]
    by_kind = {"logits": "logits", "recurrent state": "state", "one provider": "provider", "long decode": "long"}
    seen = set()
    for label, (max_abs, rel) in rows.items():
        kind = next((k for prefix, k in by_kind.items() if label.startswith(prefix)), None)
        if kind is None:
            continue
        seen.add(kind)
        assert _num(rel) == fp32[kind]["rel_l2"], label
        if "max_abs" in fp32[kind]:
            assert _num(max_abs) == fp32[kind]["max_abs"], label
        else:
            assert max_abs == "—", label
    assert seen == set(by_kind.values())
    greedy = next(v for k, v in rows.items() if k.startswith("greedy"))
    assert f"≥ {fp32['top1']['min_agreement'] * 100:g} %" in greedy[1]


def test_errors_measure_max_abs_and_relative_l2():
    ref = np.array([3.0, 4.0])
    e = errors(np.array([3.0, 4.5]), ref)
    assert e.max_abs == pytest.approx(0.5) and e.rel_l2 == pytest.approx(0.5 / 5.0) and e.nonfinite == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_is_never_within_any_budget(bad):
    e = errors(np.array([1.0, bad], np.float32), np.array([1.0, 1.0], np.float32))
    assert e.nonfinite == 1 and math.isinf(e.max_abs)
    assert not within(e, {})  # not even an empty (unbounded) budget


def test_shape_mismatch_and_integer_states():
    assert math.isinf(errors(np.zeros(3), np.zeros(4)).max_abs)
    assert errors(np.array([1, 2]), np.array([1, 2])) == Errors(0.0, 0.0, 0)
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
