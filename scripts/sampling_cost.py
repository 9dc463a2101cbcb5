"""The cost of one sampling step at large vocabularies: the full sort sampling used to do, against the
selection it does now, in the Python runtime and (where node is installed) in the JavaScript runtime.

    python scripts/sampling_cost.py [--vocab 32000 65536 250000] [--reps 41] [--json out.json] [--no-node]

One step is what a decode step spends choosing a token from one row of float32 logits: temperature, the
top-k / top-p masks, the softmax and the seeded draw (``Sampler.__call__`` in Python, ``sample`` in
runtime/web/edgelin.mjs). "full sort" is the implementation both runtimes had before, copied here
unchanged (tests/runtime/test_sampling.py and tests/web/edgelin.test.mjs keep it as their reference);
"selection" is the runtime as it is. The two give the same tokens (the script checks it on every row).

Two kinds of logits: "confident" (a few tokens far ahead: the nucleus at top-p 0.9 is a handful of
tokens, most decode steps of a trained model) and "uncertain" (standard normal x 3: the nucleus at top-p
0.9 is ~4% of the vocabulary, about 10k tokens at V = 250k). The full sort and the selection alternate
within one process (one run each per round, order swapped every round) and the figure is the median of
--reps rounds, so that a busy machine slows both alike. The node half is scripts/sampling_cost.mjs, run
here on the same logits (also runnable alone: node scripts/sampling_cost.mjs LOGITS.f32 V REPS).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgelin.bench.harness import round_order
from edgelin.runtime.sampling import Sampler

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = [  # (name, temperature, top_k, top_p)
    ("top-p 0.9", 1.0, 0, 0.9),
    ("top-k 50, top-p 0.95", 1.0, 50, 0.95),
    ("top-k 50", 1.0, 50, 1.0),
]


# ---- the implementation before (the whole row sorted for top-p), unchanged -------------------------
def _softmax(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_k_mask(x, k):
    if k <= 0 or k >= x.shape[-1]:
        return np.ones(x.shape, dtype=bool)
    return x >= np.partition(x, -k, axis=-1)[..., -k, None]


def _top_p_mask(x, p):
    if p >= 1.0:
        return np.ones(x.shape, dtype=bool)
    probs = _softmax(x)
    order = np.argsort(-probs, axis=-1, kind="stable")
    ranked = np.take_along_axis(probs, order, axis=-1)
    before = np.cumsum(ranked, axis=-1) - ranked
    mask = np.zeros(x.shape, dtype=bool)
    np.put_along_axis(mask, order, before < p, axis=-1)
    return mask


def full_sort_step(logits, temperature, top_k, top_p, rng):
    x = logits.astype(np.float64) / temperature
    cdf = np.cumsum(_softmax(np.where(_top_k_mask(x, top_k) & _top_p_mask(x, top_p), x, -np.inf)), axis=-1)
    u = rng.random(cdf.shape[0]) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=-1), cdf.shape[-1] - 1).astype(np.int64)


# ---- logits --------------------------------------------------------------------------------------
def logits_of(kind: str, V: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.standard_normal(V) * 3
    if kind == "confident":
        x[g.choice(V, 5, replace=False)] += [30.0, 29.0, 28.0, 27.5, 27.0]
    return x.astype(np.float32)[None]  # [1, V]


def python_costs(logits, reps: int) -> dict:
    out = {}
    for name, t, k, p in SETTINGS:
        fast = Sampler(t, k, p)
        times = {"full sort": [], "selection": []}
        for r in range(reps):
            runs = {"full sort": lambda: full_sort_step(logits, t, k, p, np.random.default_rng(r)),
                    "selection": lambda: fast(logits, np.random.default_rng(r))}
            ids = {}
            for which in round_order(list(runs), r):
                start = time.perf_counter()
                ids[which] = runs[which]()
                times[which].append(time.perf_counter() - start)
            if ids["full sort"].tolist() != ids["selection"].tolist():
                raise SystemExit(f"{name}: the selection chose {ids['selection']}, the full sort {ids['full sort']}")
        kept = int((fast.probs(logits) > 0).sum())
        out[name] = {w: float(np.median(v)) * 1e3 for w, v in times.items()} | {"kept": kept}
    return out


def node_costs(node: str, logits, reps: int, tmp: Path) -> dict:
    path = tmp / "logits.f32"
    logits[0].astype("<f4").tofile(path)
    script = ROOT / "scripts" / "sampling_cost.mjs"
    done = subprocess.run([node, str(script), str(path), str(logits.shape[-1]), str(reps)], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"node failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_000, 65_536, 250_000])
    ap.add_argument("--reps", type=int, default=41, help="rounds per figure (median)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--no-node", action="store_true", help="the Python runtime only")
    args = ap.parse_args(argv)
    node = None if args.no_node else (shutil.which("node") or shutil.which("nodejs"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for V in args.vocab:
            for kind in ("confident", "uncertain"):
                logits = logits_of(kind, V)
                py = python_costs(logits, args.reps)
                js = node_costs(node, logits, args.reps, Path(tmp)) if node else {}
                for name, *_ in SETTINGS:
                    row = {"V": V, "logits": kind, "setting": name, "kept": py[name]["kept"],
                           "python_full_ms": py[name]["full sort"], "python_selection_ms": py[name]["selection"]}
                    if name in js:
                        row |= {"node_full_ms": js[name]["full sort"], "node_selection_ms": js[name]["selection"]}
                    rows.append(row)
                    print(_line(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"reps": args.reps, "rows": rows}, indent=1) + "\n")
    return 0


def _line(row) -> str:
    def ms(key):
        return f"{row[key]:8.2f}" if key in row else "       -"

    return (f"V {row['V']:>7,}  {row['logits']:9s}  {row['setting']:21s} kept {row['kept']:>6,}  ms/step python "
            f"full {ms('python_full_ms')} sel {ms('python_selection_ms')}  node full {ms('node_full_ms')} sel {ms('node_selection_ms')}")


if __name__ == "__main__":
    sys.exit(main())
