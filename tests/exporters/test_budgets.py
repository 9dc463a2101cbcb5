"""Budgets that scale with the logits, and budgets of the user's own (export --budget, validate --budget).

A model whose logits reach ~100 is exported correctly to within fp32 rounding of *its* scale: the logits budget
is relative to the reference's largest |logit| (``max_rel``), so that export passes while a model off by a
fraction of a percent still fails. A bound stated at export is recorded in edgelin.json and held by validate.
"""

from __future__ import annotations

import copy
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
    _a_wrong_head_row_fails(_loud_model(), loud[1])


def _a_wrong_head_row_fails(wrong, out) -> None:
    """``wrong`` (the exported model, rebuilt) with one head row off by 0.1 % fails prefill and decode against ``out``."""
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


def test_export_budget_is_held_by_the_smoke_check_and_recorded(tmp_path, trace_cache):
    # a budget acts after the trace: the run's trace cache gives both exports the loud model's traced graphs
    model = _loud_model()
    with pytest.raises(ExportError, match="smoke check failed.*--budget"):
        export(model, tmp_path / "tight", budget={"logits": {"max_rel": 1e-12}}, trace_cache=trace_cache)
    assert not (tmp_path / "tight").exists() and list(tmp_path.iterdir()) == []
    out = tmp_path / "own"
    export(model, out, budget={"logits": {"max_rel": 2e-5}, "top1": {"min_agreement": 0.97}}, trace_cache=trace_cache)
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["parity_budgets"] == {"logits": {"max_rel": 2e-5}, "top1": {"min_agreement": 0.97}}
    report = validate(out, model, steps=4)
    assert report.overrides == manifest["parity_budgets"] and report.passed, report.table()
    assert next(c for c in report.checks if c.name.startswith("top-1")).budget == {"min_agreement": 0.97}
    # --budget at validate applies over the export's own, bound by bound
    again = validate(out, model, steps=4, budget={"logits": {"rel_l2": 1e-4}})
    assert again.overrides == {"logits": {"max_rel": 2e-5, "rel_l2": 1e-4}, "top1": {"min_agreement": 0.97}}


def test_cli_budget_options(loud, trace_cache, tmp_path):
    model, out = loud
    ckpt = tmp_path / "ckpt"
    from edgelin.checkpoint import save_checkpoint

    save_checkpoint(model, ckpt)
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "o"), "--budget", "logits.max_rel=1e-12",
                                       "--trace-cache", str(trace_cache)])
    assert result.exit_code == 2 and "smoke check failed" in result.stderr and "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "o").exists()
    result = CliRunner().invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--budget", "logits.max_rel=1e-12"])
    assert result.exit_code == 1, result.output
    assert "budgets set for this export or by --budget: logits.max_rel=1e-12" in result.output


# ---- the rounding floor: a model fp32 itself cannot compute to the budget ---------------------------------
J, K, THIRD = 0, 1, 3.0  # residual channel K is 3x channel J; the head reads M x (h_K - 3 h_J), nearly zero
CANCEL = 100.0


def _cancelling_model(M: float = CANCEL):
    """The tiny model with a head that subtracts two nearly equal large numbers: its logits are nearly the tiny
    model's (the added term cancels up to the weights' own fp32 storage), but fp32 rounds channel K and 3 x channel
    J differently, and M amplifies the difference: PyTorch fp32 is ~7e-5 max rel from float64 here (the budget is 1e-5), a model
    as badly conditioned as fla's GLA 340M (24 layers, init range 0.006) is through depth alone."""
    model = tiny_model("elu+1", tie_embeddings=False, seed=3)
    with torch.no_grad():
        model.embed.weight[:, K] = THIRD * model.embed.weight[:, J]
        for block in model.blocks:
            block.attn.o_proj.weight[K] = THIRD * block.attn.o_proj.weight[J]
            block.mlp.down.weight[K] = THIRD * block.mlp.down.weight[J]
        model.norm.weight[K] = model.norm.weight[J]
        a = torch.randn(model.lm_head.weight.shape[0], generator=torch.Generator().manual_seed(1))
        model.lm_head.weight[:, K] += M * a
        model.lm_head.weight[:, J] -= THIRD * M * a
    return model


@pytest.fixture(scope="module")
def cancelling(export_of):
    model = _cancelling_model()
    return model, export_of(model, {"cancelling_tiny_model": [J, K, THIRD, CANCEL], "config": model.model_config()}, label="cancel", check=True)


def test_rounding_floor_of_the_cancelling_model_is_above_the_budget():
    """The premise, measured: fp32 PyTorch is out of the fp32 budget against the same model in float64, and the
    head's added term nearly cancels (in float64 the logits are the plain model's to 1e-4 of their scale)."""
    model, plain = _cancelling_model(), _cancelling_model(0.0)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref64, plain64 = (copy.deepcopy(m).double()(ids)[0].numpy() for m in (model, plain))
        floor = parity.errors(model(ids)[0].numpy(), ref64)
    assert parity.errors(ref64, plain64).max_rel < 1e-4
    assert floor.max_rel > 3 * parity.BUDGETS["fp32"]["logits"]["max_rel"], floor


def test_floored_raises_to_the_floor_and_keeps_what_a_user_set():
    table = {"max_rel": 1e-5, "rel_l2": 1e-5, "max_abs": 1e-3}
    floor = parity.Errors(max_abs=9.0, rel_l2=1e-6, nonfinite=0, max_rel=1e-4)
    got = parity.floored(table, floor)
    assert got == {"max_rel": parity.FLOOR_FACTOR * 1e-4, "rel_l2": 1e-5, "max_abs": 1e-3}  # never lowered; max_abs never raised
    assert parity.floored(table, floor, keep={"max_rel": 1e-5})["max_rel"] == 1e-5
    assert parity.floored(table, None) == table and parity.floored(table, parity.INF) == table
    assert parity.floored({"rel_l2": 1e-5}, parity.Errors(0.0, 1e-4, 0, None)) == {"rel_l2": parity.FLOOR_FACTOR * 1e-4}


def test_a_model_fp32_cannot_compute_to_the_budget_exports_and_validates_within_its_floor(cancelling):
    """The export's smoke check and validate hold fp32 comparisons to FLOOR_FACTOR x the model's own rounding
    (PyTorch fp32 vs float64 on the same inputs) where that is above edgelin's budget, and say so."""
    model, out = cancelling
    gold = json.loads((out / "golden.json").read_text())
    assert gold["rounding_floor"]["max_rel"] > parity.BUDGETS["fp32"]["logits"]["max_rel"]
    assert gold["budgets"]["logits"]["max_rel"] == parity.FLOOR_FACTOR * gold["rounding_floor"]["max_rel"]
    report = validate(out, model, steps=8)
    assert report.passed, report.table()
    raised = [c for c in report.checks if c.floored]
    assert {c.group for c in raised} >= {"prefill", "decode", "golden"}, report.table()
    assert all(c.budget["max_rel"] > parity.BUDGETS["fp32"]["logits"]["max_rel"] for c in raised if "max_rel" in c.budget)
    # the comparisons the floor was needed for: over edgelin's budget, within the floor's
    assert max(c.max_rel for c in report.checks if c.group in ("prefill", "decode")) > parity.BUDGETS["fp32"]["logits"]["max_rel"]
    assert report.rounding_floor["logits"]["max_rel"] > parity.BUDGETS["fp32"]["logits"]["max_rel"]
    assert "rounding floor: PyTorch fp32 itself is up to" in report.table()


def test_the_floor_does_not_hide_a_wrong_model_or_override_a_user(cancelling):
    model, out = cancelling
    _a_wrong_head_row_fails(_cancelling_model(), out)
    # a bound the user states is held as stated, floor or not
    report = validate(out, model, steps=4, budget=["logits.max_rel=1e-5"])
    assert not report.passed and any(c.group == "prefill" and c.failed and c.budget["max_rel"] == 1e-5 for c in report.checks)


def _float32_only(model):
    """``model`` as a caller's module that computes in float32 only (it refuses float64 weights)."""

    class Float32Only(type(model)):
        def forward(self, *args, **kwargs):
            if self.embed.weight.dtype != torch.float32:
                raise RuntimeError("this model computes in float32 only")
            return super().forward(*args, **kwargs)

    model.__class__ = Float32Only
    return model


def test_a_model_that_runs_in_float32_only_is_held_to_the_budgets_as_they_are(loud, tmp_path):
    """The floor needs the model in float64; a caller's module that refuses it is held to edgelin's budgets as they
    are, and the report and the export say the floor was not measured (never a crash)."""
    model, out = loud
    report = validate(out, _float32_only(_loud_model()), steps=4)
    assert report.passed and "float32 only" in report.rounding_floor["not_measured"], report.table()
    assert not any(c.floored for c in report.checks) and "rounding floor: not measured" in report.table()
    # the export measures the floor only where edgelin's budget is not met: the cancelling model, which then fails
    said, strict = [], _float32_only(_cancelling_model())
    with pytest.raises(ExportError, match="smoke check failed"):
        export(strict, tmp_path / "o", progress=said.append)
    assert any("rounding floor not measured" in m and "float32 only" in m for m in said), said
    assert not (tmp_path / "o").exists() and next(strict.parameters()).dtype == torch.float32  # a caller's module is never converted
