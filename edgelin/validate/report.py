"""The report of a validation: one ``Check`` per comparison (its numbers, the budget it was held to, a verdict, where
it diverged first), the ``Report`` of them all with its table and its JSON file, and which budget kind each check
group is held to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgelin import parity, upstream as up
from edgelin.parity import BUDGETS
from edgelin.runtime.files import json_format, write_json

PASS, FAIL, NA = "pass", "fail", "n/a"
REPORT_FORMAT = "edgelin-validate/1"  # the report's own format key: how a later --json recognises a report edgelin wrote
REPORT_FILE = json_format("edgelin-validate/", "an edgelin validate report (JSON with format edgelin-validate/1)")

# check group -> the budget kind it is held to (before the rounding floor)
KIND_OF = {"prefill": "logits", "decode": "logits", "graphs": "logits", "golden": "logits", "providers": "provider", "long": "long",
            "kv": "long", "upstream": "upstream"}
PRECISION_KINDS = ("logits", "upstream")  # the kinds the fp16 precision floor raises (edgelin.upstream.precision_floor)
PRECISION_FLOORED = tuple(group for group, kind in KIND_OF.items() if kind in PRECISION_KINDS)


@dataclass
class Check:
    group: str  # structure | prefill | decode | graphs | golden | providers | long | behaviour | routing
    name: str
    status: str  # pass | fail | n/a
    max_abs: float | None = None
    rel_l2: float | None = None
    budget: dict[str, float] = field(default_factory=dict)
    where: str = ""  # on failure: first diverging step / layer / state, or what is wrong
    max_rel: float | None = None  # max abs / max(1, max |reference|): the bound that scales with the logits
    floored: bool = False  # the budget was raised to the model's rounding floor (parity.floored)

    @classmethod
    def of(cls, group: str, name: str, ok: bool, errors: parity.Errors, budget: dict[str, float], where: str = "") -> "Check":
        """A numeric check from its (worst) errors."""
        return cls(group, name, PASS if ok else FAIL, errors.max_abs, errors.rel_l2, dict(budget), where, errors.max_rel)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class Report:
    export_dir: str
    checkpoint: str
    precision: str
    providers: dict[str, str]  # requested -> "active" | "not available: why"
    checks: list[Check] = field(default_factory=list)
    drift: list[dict[str, float]] = field(default_factory=list)  # long stream: step -> errors
    heldout: dict[str, float] = field(default_factory=dict)  # bits/byte of the export and fp32 PyTorch, delta, top-1
    seconds: float = 0.0
    strict_providers: bool = True  # an unavailable provider that was asked for by name fails the run
    budgets: dict[str, dict[str, float]] = field(default_factory=dict)  # the budgets held to (overrides included)
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # bounds set by the export or --budget
    # the framework's own run (--upstream): framework, how it ran, its model class, seconds; {} where none ran
    upstream: dict[str, Any] = field(default_factory=dict)
    prepack: bool = True  # ONNX Runtime's CPU sessions packed their weights (the runtime's default) or read them in place
    # the model's own fp32 rounding, the worst the checks measured (PyTorch fp32 vs float64 on their inputs):
    # {"logits": {"max_rel", "rel_l2"}, "state": {"rel_l2"}, "factor"}; budgets below factor x it were raised to it
    rounding_floor: dict[str, Any] = field(default_factory=dict)
    # fp16 exports of a transformers checkpoint: its framework's own error at fp16 (measured at export, from the
    # manifest's "precision_floor"); logits and upstream budgets below PRECISION_FACTOR x it were raised to it
    precision_floor: dict[str, Any] = field(default_factory=dict)
    # int8 / int4: what the PyTorch model the states were held to computes (edgelin.quantref.arithmetic); "" where
    # the states were held to fp32 PyTorch
    state_reference: str = ""

    @property
    def passed(self) -> bool:
        if any(c.failed for c in self.checks):
            return False
        if self.strict_providers and any(v != "active" for v in self.providers.values()):
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        d = {"format": REPORT_FORMAT, **asdict(self)}
        d["passed"] = self.passed
        d["budgets"] = self.budgets or BUDGETS[self.precision]
        return d

    def table(self) -> str:
        rows = [("group", "check", "max abs", "max rel", "rel L2", "budget", "result")]
        for c in self.checks:
            budget = " ".join(f"{k[4:]}>={v:g}" if k.startswith("min_") else f"{k}<={v:g}" for k, v in c.budget.items())
            rows.append((c.group, c.name, _num(c.max_abs), _num(c.max_rel), _num(c.rel_l2), budget, c.status.upper() if c.failed else c.status))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for c in self.checks:
            if c.where and c.status != PASS:
                lines.append(f"  {c.group}/{c.name}: {c.where}")
        if self.drift:
            last = self.drift[-1]
            lines.append(
                f"long stream: {int(last['step'])} steps, max abs logits error {last['max_abs']:.2e}, "
                f"rel L2 {last['rel_l2']:.2e} at the end (drift curve in --json)"
            )
        if self.upstream.get("framework"):
            u = self.upstream
            lines.append(f"upstream: {u['model_class']} run by {u['how']}, {u['seconds']['total']:.1f} s")
        raised = [c for c in self.checks if c.floored]
        if self.rounding_floor.get("not_measured"):
            lines.append(f"rounding floor: not measured everywhere: {self.rounding_floor['not_measured']}; edgelin's budgets apply as they are there")
        if self.precision_floor:
            p = self.precision_floor
            lines.append(f"precision floor: {up.possessive(p['framework'])} own model in {p['dtype']} is {p['max_rel']:.1e} (max rel) / "
                         f"{p['rel_l2']:.1e} (rel L2) from its float64 run (measured at export); logits budgets below {p['factor']:g}x it "
                         "were raised to it")
            raised = [c for c in raised if c.group not in PRECISION_FLOORED]
        if raised:
            f = self.rounding_floor
            lines.append(f"rounding floor: PyTorch fp32 itself is up to max rel {f['logits']['max_rel']:.1e}, rel L2 {f['logits']['rel_l2']:.1e} "
                         f"(states {f['state']['rel_l2']:.1e}) from float64 on these inputs; {len(raised)} check(s) held to "
                         f"{f['factor']:g}x it where edgelin's budget is lower")
        if self.state_reference:
            lines.append(f"states held to PyTorch computing the export's {self.precision} arithmetic ({self.state_reference}); the logits to fp32 PyTorch")
        if not self.prepack:
            lines.append("ONNX Runtime's CPU session read the weights in place (--no-prepack): the same kernels on unpacked weights")
        if self.overrides:
            lines.append("budgets set for this export or by --budget: "
                         + ", ".join(f"{k}.{b}={v:g}" for k, bounds in self.overrides.items() for b, v in bounds.items()))
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, NA)}
        verdict = "PASS" if self.passed else "FAIL"
        tail = ""
        if self.strict_providers and any(v != "active" for v in self.providers.values()):
            tail = " -- a provider named in --providers is not available"
        lines.append(f"{verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[NA]} not available ({self.seconds:.1f} s){tail}")
        return "\n".join(lines)

    def write_json(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the report atomically. An existing file is replaced only if it is an earlier report (its
        ``format`` is ``edgelin-validate/...``) and not part of an export, or with ``overwrite=True``."""
        # non-finite errors (a failed check) become null: valid JSON
        write_json(path, self.to_dict(), overwrite=overwrite, ours=REPORT_FILE, what="report file")


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"
