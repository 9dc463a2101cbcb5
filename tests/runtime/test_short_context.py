"""A model whose declared context (max_positions) is shorter than the export's fixed inputs (the smoke check's prompt,
golden.json's plan, check's timing) exports and checks: the fixed inputs are made to fit its context."""

from __future__ import annotations

import json

import pytest

from edgelin.runtime import golden
from edgelin.runtime.manifest import Manifest

CONTEXT = 20  # below the tiny model's chunk of 16 + 5 prompt tokens + 8 decode steps


@pytest.fixture(scope="module")
def short(exported):
    """A hybrid (a KV cache of 16 positions) that declares a context of 20, exported with its smoke check."""
    return exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=16, max_positions=CONTEXT, options={"check": True})[1]


def test_it_exports_with_its_smoke_check_and_golden_plan_inside_the_context(short):
    m = Manifest.load(short)
    gold = golden.Golden.load(short, m)
    assert m.max_positions == CONTEXT
    assert gold.plan.prompt.shape[1] + gold.plan.decode.shape[1] <= CONTEXT


def test_check_runs_within_the_context(short):
    report = golden.check(short, ["cpu"])  # with timing: its decode steps too
    assert report.passed, report.table()


def test_check_of_such_an_export_without_golden_outputs_fits_its_plan_too(short, tmp_path):
    import shutil

    out = tmp_path / "old"
    shutil.copytree(short, out)
    (out / golden.GOLDEN_FILE).unlink()
    m = json.loads((out / "edgelin.json").read_text())
    del m["golden"]
    (out / "edgelin.json").write_text(json.dumps(m, indent=2))
    report = golden.check(out, ["cpu"], timing=False)
    assert report.runs[0].status == "active", report.table()


@pytest.mark.parametrize("context", [2, 3, 5, 9, 20, 28, 29, 30, 100])
@pytest.mark.parametrize(("chunk", "min_sequence"), [(16, 1), (64, 1), (4, 3)])
def test_every_plan_fits_its_context(context, chunk, min_sequence):
    if context < min_sequence + 1:
        with pytest.raises(ValueError, match="holds no prompt"):
            golden.plan_for(256, chunk, min_sequence, max_positions=context)
        return
    plan = golden.plan_for(256, chunk, min_sequence, max_positions=context)
    assert plan.prompt.shape[1] + plan.decode.shape[1] <= context and plan.decode.shape[1] >= 1
    assert sum(plan.pieces) == plan.prompt.shape[1] and min(plan.pieces) >= min_sequence
    assert all(0 <= p < plan.prompt.shape[1] for p in plan.positions)
    usual = golden.plan_for(256, chunk, min_sequence)
    if usual.prompt.shape[1] + usual.decode.shape[1] <= context:  # room for the usual plan: unchanged
        assert (plan.pieces, plan.positions) == (usual.pieces, usual.positions)
        assert (plan.prompt == usual.prompt).all() and (plan.decode == usual.decode).all()
