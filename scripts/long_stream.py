"""A long stream through an export: state-carried prefill pieces, then decode steps, against float64 PyTorch.

    python scripts/long_stream.py EXPORT [EXPORT ...] --tokens 100000 [--piece 2048] [--decode 64] [--json out.json]

The stream is the bundled model's held-out text (standard-library modules and pydoc topics it never saw
in training, about 1.1 MB), repeated if ``--tokens`` asks for more. Every
export reads it in prefill pieces of ``--piece`` tokens with the state carried between them, then decodes
``--decode`` more tokens one by one; a float64 copy of the source model reads the same tokens the same way.
Reported at 1k / 10k / 100k / 1M tokens (those the stream reaches): the logits error of the piece that
ends there (max abs, relative L2) against float64, whether every logit and state so far was finite, and the
largest |z| and |S| of the float64 state (the running sums: without decay they grow with the tokens read).
Torch and ONNX Runtime run on one thread. Times are wall time on whatever machine runs this.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgelin import parity
from edgelin.checkpoint import load_checkpoint
from edgelin.models import bundled_checkpoint
from edgelin.models import corpus
from edgelin.runtime.manifest import Manifest
from edgelin.runtime.session import Session
from edgelin.state import fresh_state

MARKS = (1_000, 10_000, 100_000, 1_000_000)


def stream(tokens: int) -> np.ndarray:
    text = corpus.heldout_text("code") + corpus.heldout_text("topic")
    return np.resize(np.frombuffer(text, dtype=np.uint8).astype(np.int64), tokens)[None]  # [1, tokens]


def sums(state: dict) -> tuple[float, float]:
    """Largest |z| and |S| over the layers of a PyTorch state."""
    z = max(float(v.abs().max()) for k, v in state.items() if k.endswith(".z"))
    s = max(float(v.abs().max()) for k, v in state.items() if k.endswith(".S"))
    return z, s


def run(exports: list[Path], tokens: int, piece: int, decode: int) -> dict:
    torch.set_num_threads(1)
    manifest = Manifest.load(exports[0])
    checkpoint = bundled_checkpoint()
    model64 = copy.deepcopy(load_checkpoint(checkpoint)).double().eval()
    sessions = {str(e): Session(e, "cpu", threads=1) for e in exports}
    precisions = {str(e): Manifest.load(e).precision for e in exports}
    ids = stream(tokens + decode)
    ref_state = fresh_state(manifest.states, 1, dtype=torch.float64)
    states = {k: s.new_state(1) for k, s in sessions.items()}
    rows, finite = [], {k: True for k in sessions}
    worst = {k: parity.NONE for k in sessions}
    seconds = {k: 0.0 for k in sessions} | {"float64": 0.0}
    marks = [m for m in MARKS if m <= tokens] + ([tokens] if tokens not in MARKS else [])
    for start in range(0, tokens, piece):
        chunk = ids[:, start : min(start + piece, tokens)]
        t0 = time.perf_counter()
        with torch.no_grad():
            ref, ref_state = model64(torch.from_numpy(chunk), ref_state)
        seconds["float64"] += time.perf_counter() - t0
        ref = ref.numpy()
        end = start + chunk.shape[1]
        hit = [m for m in marks if start < m <= end]
        for key, session in sessions.items():
            t0 = time.perf_counter()
            got = session.prefill(chunk, states[key])
            seconds[key] += time.perf_counter() - t0
            finite[key] = finite[key] and bool(np.isfinite(got).all()) and all(np.isfinite(v).all() for v in states[key].numpy().values())
            err = parity.errors(got, ref)
            worst[key] = worst[key].worst(err)
            for m in hit:
                e = parity.errors(got[:, m - start - 1], ref[:, m - start - 1])
                rows.append({"export": key, "precision": precisions[key], "tokens": m, "max_abs": e.max_abs, "rel_l2": e.rel_l2,
                             "worst_max_abs": worst[key].max_abs, "worst_rel_l2": worst[key].rel_l2, "finite": finite[key]})
        for m in hit:
            z, s = sums(ref_state)
            rows.append({"export": "float64", "tokens": m, "max_z": z, "max_S": s})
        if (start // piece) % 50 == 0:
            print(f"  {end:,} tokens: " + ", ".join(f"{precisions[k]} {seconds[k]:.0f} s" for k in sessions) + f", float64 {seconds['float64']:.0f} s",
                  file=sys.stderr, flush=True)
    tail = {}
    for key, session in sessions.items():
        state, ref_s = states[key], {k: v.clone() for k, v in ref_state.items()}
        err = parity.NONE
        for t in range(tokens, tokens + decode):
            got = session.decode(ids[:, t : t + 1], state)
            with torch.no_grad():
                ref, ref_s = model64.step(torch.from_numpy(ids[:, t : t + 1]), ref_s)
            err = err.worst(parity.errors(got, ref.numpy()))
            finite[key] = finite[key] and bool(np.isfinite(got).all())
        tail[key] = {"steps": decode, "max_abs": err.max_abs, "rel_l2": err.rel_l2, "finite": finite[key]}
    return {"tokens": tokens, "piece": piece, "rows": rows, "decode_after": tail, "seconds": seconds, "precisions": precisions}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("exports", nargs="+", type=Path)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--piece", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = run(args.exports, args.tokens, args.piece, args.decode)
    for r in out["rows"]:
        if r["export"] == "float64":
            print(f"{r['tokens']:>9,}  float64 state: max |z| {r['max_z']:.4g}, max |S| {r['max_S']:.4g}")
        else:
            print(f"{r['tokens']:>9,}  {r['precision']:5s} logits at this token: max abs {r['max_abs']:.2e} rel L2 {r['rel_l2']:.2e}; "
                  f"worst so far {r['worst_max_abs']:.2e} / {r['worst_rel_l2']:.2e}; finite {r['finite']}")
    for k, t in out["decode_after"].items():
        print(f"then {t['steps']} decode steps, {out['precisions'][k]}: max abs {t['max_abs']:.2e} rel L2 {t['rel_l2']:.2e} finite {t['finite']}")
    print("seconds: " + ", ".join(f"{out['precisions'].get(k, k)} {v:.0f}" for k, v in out["seconds"].items()))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=lambda x: None if isinstance(x, float) and not math.isfinite(x) else x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
