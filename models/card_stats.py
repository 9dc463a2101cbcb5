"""Held-out figures for the bundled model's card: bits/byte per held-out file and per group.

    python -m edgelin.models.card_stats models/stdlib-linear [--seq-len 512] [--json out.json]

Every held-out document (whole standard-library files and pydoc topics the model never saw) is scored on
its own (``heldout_bits_per_byte``: windows of seq_len bytes, each from an empty state); the groups are
scored as the training recipe scores them (the documents joined). Prints a table and, per kind, the
median and the 10th/90th percentile over files, weighted by nothing (each file counts once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def main(argv=None) -> int:
    from edgelin.checkpoint import load_checkpoint
    from edgelin.models import corpus
    from edgelin.models.train import directory_text, evaluation_sets, heldout_bits_per_byte, score_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--eval-dir", type=Path, action="append", default=[], help="also score every *.py under this folder")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint).eval()
    texts = evaluation_sets() | {str(folder): directory_text(folder) for folder in args.eval_dir}
    out = {"file_list_sha256": corpus.file_list_sha256(), "seq_len": args.seq_len, "files": {},
           "groups": score_texts(model, texts, args.seq_len, corpus.join(corpus.select(heldout=False)))}
    for doc in corpus.select(heldout=True):
        if len(doc.text) >= 2:
            out["files"][doc.name] = {"kind": doc.kind, "bytes": len(doc.text), "bpb": heldout_bits_per_byte(model, doc.text, args.seq_len)}
    for kind in ("code", "topic"):
        v = np.array([f["bpb"] for f in out["files"].values() if f["kind"] == kind])
        out[f"per_file_{kind}"] = {"n": int(v.size), "median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
                                   "p90": float(np.percentile(v, 90)), "min": float(v.min()), "max": float(v.max())}
        print(f"per {kind} file: n {v.size}, median {np.median(v):.3f}, p10 {np.percentile(v, 10):.3f}, p90 {np.percentile(v, 90):.3f}, "
              f"min {v.min():.3f}, max {v.max():.3f}")
    for name, f in sorted(out["files"].items(), key=lambda kv: kv[1]["bpb"]):
        print(f"  {f['bpb']:.3f}  {f['bytes']:>8,}  {name}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
