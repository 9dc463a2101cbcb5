"""Figures of validate's upstream comparison per family: how close edgelin's import is to the framework's own model,
what a misread config field looks like, and what the framework's run costs on this machine.

    python scripts/upstream_figures.py [--steps 64] [--out docs/bench/upstream.json] [FAMILY ...]   (FAMILY ...: those rows re-run, the others kept)

For each family of tests/importers/test_upstream.py (the same tiny random checkpoints, the same misread fields) it
runs the framework's own model as ``edgelin validate --upstream`` does (edgelin.upstream.run: a prompt of 69 tokens,
batch 2, ``--steps`` cached decode steps, 16 greedy tokens) and compares edgelin's import with it, then the wrongly
imported model; for transformers (run in float64, its float32 casts lifted) also edgelin's import in float64, which
should compute the same function. Needs the test extra (transformers, fla, triton).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # fla's kernels in Triton's interpreter (before fla is imported)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Patch:
    """The bits of pytest's monkeypatch the misread cases use."""

    def __init__(self) -> None:
        self.undo = []

    def setattr(self, target, name, value) -> None:
        self.undo.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def restore(self) -> None:
        for target, name, value in reversed(self.undo):
            setattr(target, name, value)
        self.undo.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch

    from edgelin import parity, upstream
    from edgelin.checkpoint import load_checkpoint
    from testkit import hf_oracle

    cases = _module("upstream_cases", ROOT / "tests" / "importers" / "test_upstream.py").CASES
    fla = _module("fla_conftest", ROOT / "tests" / "importers" / "conftest.py")
    budget = parity.BUDGETS["fp32"]["upstream"]
    rng = np.random.default_rng(0)
    prompt, steps = rng.integers(0, 97, (2, 69)), rng.integers(0, 97, (2, args.steps))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case_id in args.families or list(cases):
            framework, model_type, options, wrong, layer = cases[case_id]
            root = Path(tmp) / case_id
            root.mkdir()
            if framework == "transformers":
                folder, _ = hf_oracle.run(model_type, options, root, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
            else:
                fla._fla()
                folder = fla.build(root / "ckpt", model_type=model_type, **options)
            t0 = time.perf_counter()
            ref = upstream.run(folder, framework, prompt, steps)
            wall = time.perf_counter() - t0
            row = {"framework": framework, "how": ref.how, "model_class": ref.model_class, "seconds": ref.seconds, "wall_s": wall}
            for label, patch in (("import", None), ("misread", wrong)):
                undo = _Patch()
                if patch is not None:
                    patch(undo)
                try:
                    model = load_checkpoint(folder)
                    p, d, g, hidden = upstream.import_outputs(model, prompt, steps, ref.greedy.shape[1])
                finally:
                    undo.restore()
                ep, ed = parity.errors(p, ref.prefill), parity.errors(d, ref.decode)
                row[label] = {"prefill": vars(ep), "decode": vars(ed), "greedy_agreement": upstream.greedy_agreement(g, ref.greedy)[0],
                              "passes": parity.within(ep, budget) and parity.within(ed, budget),
                              "where": upstream.first_departure(model, hidden, ref.hidden, budget["rel_l2"])}
            if framework == "transformers":  # its run is float64 (casts lifted): the import in float64 should be the same function
                p64, d64, _, _ = upstream.import_outputs(load_checkpoint(folder).double(), prompt, steps, 1)
                row["import_float64"] = {"prefill": vars(parity.errors(p64, ref.prefill)), "decode": vars(parity.errors(d64, ref.decode))}
            row["misread_expected"] = layer
            rows[case_id] = row
            i, m = row["import"], row["misread"]
            print(f"{case_id:17s} {framework:12s} import max rel {i['prefill']['max_rel']:.1e}/{i['decode']['max_rel']:.1e} "
                  f"rel L2 {i['prefill']['rel_l2']:.1e}/{i['decode']['rel_l2']:.1e} greedy {i['greedy_agreement']:.2f} | "
                  + (f"import in float64: max rel {row['import_float64']['prefill']['max_rel']:.1e}/{row['import_float64']['decode']['max_rel']:.1e} | "
                     if "import_float64" in row else "") +
                  f"misread: max rel {m['prefill']['max_rel']:.1e}, {m['where']} | {ref.model_class} {wall:.1f} s "
                  f"(load {ref.seconds['load']:.1f}, prefill {ref.seconds['prefill']:.1f}, decode {ref.seconds['decode']:.1f}, "
                  f"greedy {ref.seconds['greedy']:.1f})", flush=True)
    if args.out:
        out = Path(args.out)
        record = {"command": "python scripts/upstream_figures.py --steps %d" % args.steps, "prompt_tokens": 69, "batch": 2,
                  "decode_steps": args.steps, "greedy_tokens": upstream.GREEDY, "budget": budget, "families": rows}
        if args.families and out.is_file():  # some families re-run: the record's other rows are kept (same steps only)
            earlier = json.loads(out.read_text(encoding="utf-8"))
            if earlier.get("decode_steps") != args.steps:
                sys.exit(f"{out} holds a run of {earlier.get('decode_steps')} decode steps; re-run with --steps {earlier.get('decode_steps')}")
            record["families"] = {**earlier["families"], **rows}
        out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
