"""fp16 against the framework the model came from: edgelin's fp16 graphs and transformers' own model run in float16,
each against transformers' float64 run on the same ids, per Hugging Face family.

    python scripts/precision_floor.py [--families qwen3_5,lfm2,...] [--out docs/bench/precision_floor.json]

For each model of ``edgelin.bench.checkpoints.FAMILIES`` (one per importer family, hidden 256, random weights,
built and saved by transformers' own classes): an fp16 export (its own smoke check on), then on the smoke check's
ids (batch 2, 67 tokens, seed 0) and 4 greedy decode steps: ``edgelin.upstream.precision_floor`` (transformers in
float16 against transformers in float64, in subprocesses) and edgelin's fp16 graphs against the same float64 run.
The ratio edgelin / transformers is what ``edgelin.upstream.PRECISION_FACTOR`` (1) is judged against. Writes the
record (--out) atomically and prints one line per family.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def main() -> None:
    from edgelin import parity, upstream
    from edgelin.bench.checkpoints import FAMILIES as MODELS, build_checkpoint
    from edgelin.exporters import export
    from edgelin.runtime.files import write_json
    from edgelin.runtime.session import Session

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(MODELS), help="comma list of checkpoints.FAMILIES")
    parser.add_argument("--out", type=Path, help="write the record here (JSON)")
    args = parser.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"unknown family {unknown[0]!r}; choose from {', '.join(MODELS)}")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="edgelin-precision-floor-") as tmp:
        for name in names:
            ckpt = build_checkpoint(name, Path(tmp) / name / "ckpt", MODELS)
            out = Path(tmp) / name / "fp16"
            result = export(ckpt, out, precision="fp16")
            rng_ids = np.random.default_rng(0).integers(0, 512, (2, 67))  # the smoke check's shape; any ids do
            session = Session(out, provider="cpu", threads=2)
            state = session.new_state(2)
            logits = [session.prefill(rng_ids, state).astype(np.float64)]
            steps = rng_ids[:, :4]
            for t in range(steps.shape[1]):
                logits.append(session.decode(steps[:, t : t + 1], state)[:, -1].astype(np.float64))
            exact = upstream.run(ckpt, "transformers", rng_ids, steps, greedy=0)
            mine = parity.errors(logits[0], exact.prefill)
            for got, ref in zip(logits[1:], exact.decode):
                mine = mine.worst(parity.errors(got, ref))
            theirs = upstream.precision_floor(ckpt, "transformers", "fp16", rng_ids, steps)
            raised = json.loads((out / "edgelin.json").read_text()).get("precision_floor")
            rows[name] = {"edgelin_fp16": {"max_rel": mine.max_rel, "rel_l2": mine.rel_l2},
                          "transformers_fp16": {"max_rel": theirs.errors.max_rel, "rel_l2": theirs.errors.rel_l2},
                          "ratio_max_rel": mine.max_rel / theirs.errors.max_rel, "ratio_rel_l2": mine.rel_l2 / theirs.errors.rel_l2,
                          "export_raised_its_budget": raised is not None,
                          "smoke": {k: {"max_rel": e.max_rel, "rel_l2": e.rel_l2} for k, e in (result.smoke or {}).items()}}
            r = rows[name]
            print(f"{name:17s} edgelin fp16 {mine.max_rel:.2e} / {mine.rel_l2:.2e}   transformers fp16 {theirs.errors.max_rel:.2e} / "
                  f"{theirs.errors.rel_l2:.2e}   ratio {r['ratio_max_rel']:.2f} / {r['ratio_rel_l2']:.2f}"
                  f"{'   (export raised its budget to it)' if raised else ''}", flush=True)
    if args.out:
        record = {"command": "python scripts/precision_floor.py", "ids": "batch 2 x 67 tokens (numpy seed 0) + 4 decode steps",
                  "against": "transformers' own model in float64 (its float32 casts lifted)", "families": rows}
        write_json(args.out, record, overwrite=True)


if __name__ == "__main__":
    main()
