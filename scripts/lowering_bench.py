"""Portable vs fused graphs (``edgelin export --ops portable|fused``), per runtime, in one run: the bench's opt-in
``lowering`` section (edgelin/bench/lowering.py says what is measured), its record kept.

    python scripts/lowering_bench.py [--threads 1] [--quick] [--out docs/bench/lowering.json]

The same as ``edgelin bench --section lowering``; prints the table and writes the bench record (atomically) to --out.
The node and WASM rows need node and ``npm ci`` in this checkout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from edgelin.bench import run_bench
from edgelin.runtime.files import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/lowering.json", help="where the record goes [%(default)s]")
    ap.add_argument("--quick", action="store_true", help="one round, short lengths, tiny models: a smoke run; numbers mean little")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgelin-lowering-") as tmp:
        report = run_bench(sections=["lowering"], quick=args.quick, threads=args.threads, out_dir=tmp, plots=False,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(report.table())
    print(f"wrote {write_json(Path(args.out), report.data)}")


if __name__ == "__main__":
    main()
