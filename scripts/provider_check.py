"""Parity and speed of a second execution provider against the CPU provider, for the README's table.

    python scripts/provider_check.py EXPORT... [--provider openvino] [--rounds 3] [--json out.json]

Run in a venv whose onnxruntime build has the provider (e.g. onnxruntime-openvino; torch-free). For each export:
``edgelin check --providers cpu,PROVIDER`` (both against the golden outputs, the provider against CPU), decode
ms/token at batch 1 on one thread for both providers, interleaved over ``--rounds`` rounds (the median of
each round's median), and the nodes the provider leaves to the CPU provider (scripts/provider_nodes.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provider_nodes import placement  # noqa: E402

from edgelin.bench.harness import round_order  # noqa: E402
from edgelin.runtime import golden  # noqa: E402
from edgelin.runtime.manifest import GRAPHS, Manifest  # noqa: E402
from edgelin.runtime.providers import CPU_EP, EXECUTION_PROVIDERS, PLUGIN_PROVIDERS  # noqa: E402
from edgelin.runtime.session import Session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--provider", default="openvino", choices=[p for p in EXECUTION_PROVIDERS if p not in ("cpu", *PLUGIN_PROVIDERS)])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    ep = EXECUTION_PROVIDERS[args.provider][0]
    rows = []
    for export_dir in args.exports:
        m = Manifest.load(export_dir)
        report = golden.check(export_dir, ["cpu", args.provider], threads=1, timing=False)
        sessions = {p: Session(export_dir, provider=p, threads=1) for p in ("cpu", args.provider)}
        g = golden.Golden.load(export_dir, m)
        if g is None:
            raise SystemExit(f"{export_dir} has no golden outputs (made by an earlier edgelin); re-export it")
        ms = {p: [] for p in sessions}
        for r in range(args.rounds):
            for p in round_order(list(sessions), r):
                ms[p].append(golden.decode_ms(sessions[p], g.plan, steps=48))
        fallback = {}
        for graph in GRAPHS:
            placed = placement(m.graph_path(export_dir, graph), ep)
            fallback[graph] = sorted({op for op, _ in placed.get(CPU_EP, {}).get("ops", [])})
        res = {r.name: r for r in report.runs}
        row = {"export": str(export_dir), "precision": m.precision, "passed": report.passed,
               "decode_ms": {p: float(np.median(v)) for p, v in ms.items()}, "decode_ms_rounds": ms, "cpu_fallback_ops": fallback,
               "results": {f"{run.name}: {x.name}": {"max_abs": x.errors.max_abs, "max_rel": x.errors.max_rel, "rel_l2": x.errors.rel_l2,
                                                     "passed": x.passed} for run in report.runs for x in run.results}}
        rows.append(row)
        other = res[args.provider].results
        print(f"{export_dir}: {'PASS' if report.passed else 'FAIL'}; {args.provider} vs golden max rel "
              f"{max(x.errors.max_rel for x in other if x.group == 'golden'):.1e}, vs cpu max rel "
              f"{max(x.errors.max_rel for x in other if x.group == 'providers'):.1e}; cpu vs golden max rel "
              f"{max(x.errors.max_rel for x in res['cpu'].results):.1e}; decode ms cpu {row['decode_ms']['cpu']:.3f}, "
              f"{args.provider} {row['decode_ms'][args.provider]:.3f}; left to CPU: {fallback}")
    if args.json:
        args.json.write_text(json.dumps({"provider": ep, "rounds": args.rounds, "threads": 1, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
