"""How far fp32 itself is from the exact model, and how far an export is: the measurement behind parity.FLOOR_FACTOR.

    python scripts/rounding_floor.py CHECKPOINT EXPORT [--out docs/bench/rounding_floor.json]

On the same random ids, for prefills of 1, C + 1 and 3 C + 5 tokens (batch 1-3) and 16 decode steps (batch 2):
the logits of ONNX Runtime's fp32 graphs (CPU), of PyTorch fp32 and of PyTorch float64 (the same weights),
compared pairwise (max rel: max abs over max(1, max |reference|); rel L2). "floor" is PyTorch fp32 vs float64: what
rounding alone does to this model; the ratio column is ONNX Runtime vs PyTorch fp32 over it, the quantity
FLOOR_FACTOR must bound for a correct export to pass (validate holds that comparison to max(budget, factor x floor)).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

from edgelin import parity
from edgelin.checkpoint import load_checkpoint
from edgelin.runtime import load
from edgelin.state import fresh_state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("export", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint).eval()
    model64 = copy.deepcopy(model).double()
    session = load(args.export, provider="cpu", threads=args.threads, prepack=False)
    specs, V = session.manifest.states, session.manifest.vocab_size
    C = int(session.manifest.extra.get("chunk_size", 64))
    rng = np.random.default_rng(1)
    rows = []

    def record(name: str, ort: np.ndarray, r32: np.ndarray, r64: np.ndarray) -> None:
        pairs = {"ort_vs_fp32": parity.errors(ort, r32), "ort_vs_float64": parity.errors(ort, r64), "floor": parity.errors(r32, r64)}
        row = {"case": name, **{k: {"max_rel": e.max_rel, "rel_l2": e.rel_l2} for k, e in pairs.items()}}
        row["ratio"] = {b: getattr(pairs["ort_vs_fp32"], b) / max(getattr(pairs["floor"], b), 1e-300) for b in ("max_rel", "rel_l2")}
        rows.append(row)
        print(f"{name:22s} ORT vs fp32 {pairs['ort_vs_fp32'].max_rel:.1e} / {pairs['ort_vs_fp32'].rel_l2:.1e}   "
              f"ORT vs float64 {pairs['ort_vs_float64'].max_rel:.1e} / {pairs['ort_vs_float64'].rel_l2:.1e}   "
              f"floor {pairs['floor'].max_rel:.1e} / {pairs['floor'].rel_l2:.1e}   "
              f"ratio {row['ratio']['max_rel']:.2f} / {row['ratio']['rel_l2']:.2f}", flush=True)

    print("max rel / rel L2 of the logits", flush=True)
    with torch.no_grad():
        for batch, T in ((1, 1), (2, C + 1), (3, 3 * C + 5)):
            ids = rng.integers(0, V, (batch, T))
            state = session.new_state(batch)
            got = session.prefill(ids, state)
            r32 = model(torch.from_numpy(ids), fresh_state(specs, batch))[0].numpy()
            r64 = model64(torch.from_numpy(ids), fresh_state(specs, batch, dtype=torch.float64))[0].numpy()
            record(f"prefill T={T} batch={batch}", got, r32, r64)
        ids = rng.integers(0, V, (2, 16))
        state, s32, s64 = session.new_state(2), fresh_state(specs, 2), fresh_state(specs, 2, dtype=torch.float64)
        got, r32, r64 = [], [], []
        for t in range(ids.shape[1]):
            x = torch.from_numpy(ids[:, t : t + 1])
            got.append(session.decode(ids[:, t : t + 1], state))
            a, s32 = model.step(x, s32)
            b, s64 = model64.step(x, s64)
            r32.append(a.numpy())
            r64.append(b.numpy())
        record("decode 16 steps", *(np.concatenate(x, 1) for x in (got, r32, r64)))
    worst = max(max(r["ratio"].values()) for r in rows)
    print(f"worst ratio ORT-vs-fp32 / floor: {worst:.2f} (FLOOR_FACTOR {parity.FLOOR_FACTOR:g})")
    if args.out:
        args.out.write_text(json.dumps({"checkpoint": str(args.checkpoint), "export": str(args.export), "threads": args.threads,
                                        "floor_factor": parity.FLOOR_FACTOR, "rows": rows, "worst_ratio": worst}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
