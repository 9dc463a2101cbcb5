"""Budgets that scale with the logits, and budgets of the user's own (export --budget, validate --budget).

A model whose logits reach ~100 is exported correctly to within fp32 rounding of *its* scale: the logits budget
is relative to the reference's largest |logit| (``max_rel``), so that export passes while a model off by a
fraction of a percent still fails. A bound stated at export is recorded in edgelin.json and held by validate.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import tiny_model
from edgelin import parity
from edgelin.cli import main
from edgelin.errors import ExportError
from edgelin.exporters import export
from edgelin.validate import validate

HEAD_SCALE = 15.0  # the tiny model's logits reach ~7; this head takes them to ~100


def _loud_model():
    model = tiny_model("elu+1", tie_embeddings=False, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


@pytest.fixture(scope="module")
def loud(export_of):
    model = _loud_model()
    out = export_of(model, {"loud_tiny_model": HEAD_SCALE, "config": model.model_config()}, label="loud", check=True)
    return model, out


def test_large_logits_export_and_validate_within_the_relative_budget(loud):
    model, out = loud
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0)))[0]
    assert float(logits.abs().max()) > 50  # the scale the relative bound exists for
    report = validate(out, model, steps=8)
    assert report.passed, report.table()
    prefill = [c for c in report.checks if c.group == "prefill"]
    assert prefill and all(c.max_rel <= parity.BUDGETS["fp32"]["logits"]["max_rel"] for c in prefill)
    # the relative measure is the absolute one over the reference's scale
    assert all(c.max_rel < c.max_abs for c in prefill)


def test_a_model_off_by_a_tenth_of_a_percent_still_fails(loud):
    """The relative bound is not a loose one: one head row off by 0.1 % fails prefill and decode."""
    model, out = loud
    wrong = _loud_model()
    with torch.no_grad():
        wrong.lm_head.weight[7].mul_(1.001)
    report = validate(out, wrong, steps=8)
    failed = {c.group for c in report.checks if c.failed and c.group in ("prefill", "decode")}
    assert failed == {"prefill", "decode"}, report.table()


def test_validate_budget_is_applied_and_recorded(loud):
    model, out = loud
    report = validate(out, model, steps=4, budget=["logits.max_rel=1e-12", "top1.min_agreement=0.5"])
    assert not report.passed
    assert report.overrides == {"logits": {"max_rel": 1e-12}, "top1": {"min_agreement": 0.5}}
    assert report.budgets["logits"]["max_rel"] == 1e-12 and report.budgets["logits"]["rel_l2"] == parity.BUDGETS["fp32"]["logits"]["rel_l2"]
    assert any(c.group == "prefill" and c.failed and c.budget["max_rel"] == 1e-12 for c in report.checks)
    top1 = next(c for c in report.checks if c.name.startswith("top-1"))
    assert top1.budget == {"min_agreement": 0.5}
    assert "logits.max_rel=1e-12" in report.table()
    d = report.to_dict()
    assert d["budgets"]["logits"]["max_rel"] == 1e-12 and d["overrides"]["top1"] == {"min_agreement": 0.5}
    assert parity.BUDGETS["fp32"]["logits"]["max_rel"] != 1e-12  # the table itself is untouched


def test_export_budget_is_held_by_the_smoke_check_and_recorded(tmp_path):
    model = _loud_model()
    with pytest.raises(ExportError, match="smoke check failed.*--budget"):
        export(model, tmp_path / "tight", budget={"logits": {"max_rel": 1e-12}})
    assert not (tmp_path / "tight").exists() and list(tmp_path.iterdir()) == []
    out = tmp_path / "own"
    export(model, out, budget={"logits": {"max_rel": 2e-5}, "top1": {"min_agreement": 0.97}})
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["parity_budgets"] == {"logits": {"max_rel": 2e-5}, "top1": {"min_agreement": 0.97}}
    report = validate(out, model, steps=4)
    assert report.overrides == manifest["parity_budgets"] and report.passed, report.table()
    assert next(c for c in report.checks if c.name.startswith("top-1")).budget == {"min_agreement": 0.97}
    # --budget at validate applies over the export's own, bound by bound
    again = validate(out, model, steps=4, budget={"logits": {"rel_l2": 1e-4}})
    assert again.overrides == {"logits": {"max_rel": 2e-5, "rel_l2": 1e-4}, "top1": {"min_agreement": 0.97}}


def test_cli_budget_options(loud, tmp_path):
    model, out = loud
    ckpt = tmp_path / "ckpt"
    from edgelin.checkpoint import save_checkpoint

    save_checkpoint(model, ckpt)
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "o"), "--budget", "logits.max_rel=1e-12"])
    assert result.exit_code == 2 and "smoke check failed" in result.stderr and "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "o").exists()
    result = CliRunner().invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--budget", "logits.max_rel=1e-12"])
    assert result.exit_code == 1, result.output
    assert "budgets set for this export or by --budget: logits.max_rel=1e-12" in result.output
