"""How closely an int8 / int4 export computes its own quantisation: its prefill logits and states against fp32 PyTorch
and against the quantised reference validate holds its states to (edgelin.quantref).

    python scripts/quantref_fidelity.py EXPORT CHECKPOINT [--seed 0] [--json out.json]

validate's four prefill shapes (T = 1, chunk - 1, chunk + 1, 3 chunks + 5; batch 1-3), random ids, one ONNX Runtime
session (2 threads). Per shape: rel L2 of the logits and the worst state's rel L2, each against fp32 PyTorch and
against the reference. Where no rounding step of the activations flips between the graph and the reference the two
agree to fp32 accumulation (~1e-7); a flip moves one value by a rounding step and what follows by less.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from edgelin import parity, protocol, quantref  # noqa: E402
from edgelin.checkpoint import load_checkpoint  # noqa: E402
from edgelin.runtime import Session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export")
    ap.add_argument("checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    session = Session(args.export, "cpu", threads=2)
    manifest = session.manifest
    model = load_checkpoint(args.checkpoint).float().eval()
    reference = quantref.quantised_model(model, manifest)
    if reference is None:
        sys.exit(f"{args.export}: no quantised reference ({manifest.precision}; an int8/int4 export recording its 'embedding' has one)")
    C = int(manifest.extra.get("chunk_size", protocol.chunk_size(model)))
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"{args.export}: {quantref.arithmetic(manifest)}")
    for batch, T in ((1, 1), (3, max(C - 1, 1)), (2, C + 1), (3, 3 * C + 5)):
        ids = rng.integers(0, manifest.vocab_size, (batch, T))
        state = session.new_state(batch)
        logits = session.prefill(ids, state)
        got = state.numpy()
        with torch.no_grad():
            ref, ref_state = model(torch.from_numpy(ids))
            q, q_state = reference(torch.from_numpy(ids))

        def worst(states) -> float:
            return max(parity.errors(got[s.input], states[s.key].numpy()).rel_l2 for s in manifest.states)

        row = {"batch": batch, "T": T, "logits_vs_fp32": parity.errors(logits, ref.numpy()).rel_l2,
               "logits_vs_reference": parity.errors(logits, q.numpy()).rel_l2, "state_vs_fp32": worst(ref_state),
               "state_vs_reference": worst(q_state)}
        rows.append(row)
        print(f"  T={T:4d} batch={batch}: logits rel L2 {row['logits_vs_fp32']:.2e} vs fp32, {row['logits_vs_reference']:.2e} vs the reference; "
              f"worst state {row['state_vs_fp32']:.2e} vs fp32, {row['state_vs_reference']:.2e} vs the reference")
    if args.json:
        Path(args.json).write_text(json.dumps({"export": args.export, "arithmetic": quantref.arithmetic(manifest), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
