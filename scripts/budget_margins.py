"""How close each export comes to its parity budgets: the worst error of each kind over validate reports.

    python scripts/budget_margins.py REPORT.json [REPORT.json ...] [--out docs/bench/budget_margins.json]

Each REPORT is the ``--json`` of ``edgelin validate`` (any model, any precision, any seed). For every report and
each kind of comparison (logits: prefill, decode, prefill vs decode; provider; long) it prints the worst max abs,
max rel (max abs / max(1, max |reference|)) and rel L2 over that kind's checks, the budget of this edgelin
(edgelin.parity, with the report's own overrides) and the margin (budget over the worst: below 1 is a failure);
the budget the report was held to when it ran is kept in the JSON as ``budget_when_run``. The budgets of edgelin.parity were set from these tables (see the README's
"Parity budgets"); re-run it on new models before changing one.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from edgelin import parity

KINDS = {"prefill": "logits", "decode": "logits", "graphs": "logits", "providers": "provider", "long": "long"}
BOUNDS = ("max_abs", "max_rel", "rel_l2")


def worst_by_kind(report: dict) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for c in report["checks"]:
        kind = KINDS.get(c["group"])
        if kind is None or c["status"] == "n/a":
            continue
        row = out.setdefault(kind, {b: 0.0 for b in BOUNDS})
        for b in BOUNDS:
            value = c.get(b)
            row[b] = max(row[b], math.inf if value is None else float(value))
    return out


def margins(report: dict) -> list[dict]:
    rows = []
    budgets = parity.held(report["precision"], report.get("overrides"))[0]
    for kind, worst in worst_by_kind(report).items():
        budget = budgets[kind]
        margin = min((budget[b] / worst[b] if worst[b] > 0 else math.inf) for b in BOUNDS if b in budget)
        rows.append({"kind": kind, **{f"worst_{b}": worst[b] for b in BOUNDS}, "budget": budget, "margin": margin,
                     "budget_when_run": report["budgets"][kind]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="Also write the table as JSON here.")
    args = ap.parse_args(argv)
    table = []
    print(f"{'report':40s} {'prec':5s} {'kind':8s} {'max abs':>9s} {'max rel':>9s} {'rel L2':>9s}  {'margin':>7s}  budget")
    for path in args.reports:
        report = json.loads(path.read_text(encoding="utf-8"))
        for row in margins(report):
            table.append({"report": str(path), "export": report["export_dir"], "precision": report["precision"], **row})
            budget = " ".join(f"{k}<={v:g}" for k, v in row["budget"].items())
            print(f"{path.name:40s} {report['precision']:5s} {row['kind']:8s} {row['worst_max_abs']:9.2e} {row['worst_max_rel']:9.2e} "
                  f"{row['worst_rel_l2']:9.2e}  {row['margin']:7.2f}  {budget}")
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, default=lambda x: None) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
