"""edgelin vs llama.cpp on the same checkpoints: the bench's opt-in ``llamacpp`` section, its record kept.

    bash scripts/llamacpp_build.sh /opt/llama        # once: llama.cpp from the llama-cpp-python sdist (minutes)
    EDGELIN_LLAMA_CPP=/opt/llama/llama.cpp python scripts/llamacpp_bench.py [--quick] [--out docs/bench/llamacpp.json]

Runs ``edgelin bench --section llamacpp`` (edgelin/bench/llamacpp.py: an LFM2 and a Mamba2 transformers checkpoint,
GGUF F32/F16/Q8_0/Q4_0 vs edgelin fp32/fp16/int8/int4, threads 1 and 2, decode and prefill tokens/s in alternating
rounds, greedy ids vs transformers), prints its table and writes the bench record (atomically) to --out. Fails, with
the reason, where the section was skipped: a record of nothing is not kept.
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
    ap.add_argument("--out", default="docs/bench/llamacpp.json", help="where the record goes [%(default)s]")
    ap.add_argument("--quick", action="store_true", help="one round, short lengths: a smoke run; numbers mean little")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgelin-llamacpp-") as tmp:
        report = run_bench(sections=["llamacpp"], quick=args.quick, out_dir=tmp, plots=False,
                           progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(report.table())
    part = report.data["llamacpp"]
    if part["status"] != "ok":
        sys.exit(f"llamacpp section {part['status']}: {part.get('reason', '')}; nothing written")
    print(f"wrote {write_json(Path(args.out), report.data)}")


if __name__ == "__main__":
    main()
