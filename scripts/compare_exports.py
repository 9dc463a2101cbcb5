"""Time several edgelin exports of one model against each other, interleaved, on the Python runtime.

    python scripts/compare_exports.py out-fp32/ out-int8/ out-q8/ [--threads 1,2] [--rounds 3] [--steps 200] [--prefill 4096]

For each thread count: ``--rounds`` rounds, each running every export in turn (the order reversed every other round,
so that none always goes first): ``--steps`` batch-1 decode calls after a 16-token prompt (median ms per call) and
one prefill of ``--prefill`` random tokens from an empty state (tokens/s), as a prompt goes: in the runtime's default
pieces, asking for the last position's logits (an export with ``logits_at`` computes no other). Prints the medians over rounds, each
round's figure beside them, and each export's weights file size. Any export folders the runtime loads: different
precisions, schemes or lowerings of one model are what it is for.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from edgelin.bench.harness import round_order
from edgelin.errors import EdgelinError
from edgelin.runtime.session import Session


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("exports", nargs="+", type=Path, help="export folders (edgelin.json inside)")
    ap.add_argument("--threads", default="1", help="comma-separated intra-op thread counts [1]")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds [3]")
    ap.add_argument("--steps", type=int, default=200, help="decode calls per export and round [200]")
    ap.add_argument("--prefill", type=int, default=4096, help="tokens of the timed prefill [4096]")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        sys.exit(f"--threads: {args.threads!r} is not a comma-separated list of integers")
    if min(threads) < 1 or args.rounds < 1 or args.steps < 1 or args.prefill < 1:
        sys.exit("--threads, --rounds, --steps and --prefill must be at least 1")
    names = [str(p) for p in args.exports]
    for T in threads:
        try:
            sessions = {n: Session(p, "cpu", threads=T) for n, p in zip(names, args.exports)}
        except EdgelinError as exc:
            sys.exit(f"error: {exc}")
        vocab = min(s.manifest.vocab_size for s in sessions.values())
        ids = np.random.default_rng(args.seed).integers(0, vocab, (1, max(args.prefill, 16)))
        decode = {n: [] for n in names}
        prefill = {n: [] for n in names}
        for r in range(args.rounds):
            for n in round_order(names, r):
                s = sessions[n]
                state = s.new_state(1)
                s.prefill(ids[:, :16], state)
                token, times = ids[:, :1], []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    s.decode(token, state)
                    times.append(time.perf_counter() - t0)
                decode[n].append(float(np.median(times)) * 1e3)
                state = s.new_state(1)
                t0 = time.perf_counter()
                s.prefill(ids[:, : args.prefill], state, last_only=True)
                prefill[n].append(args.prefill / (time.perf_counter() - t0))
        width = max(map(len, names))
        for n, p in zip(names, args.exports):
            size = sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".onnx", ".data"))
            print(f"threads {T}  {n:{width}s}  decode {np.median(decode[n]):.3f} ms/token ({', '.join(f'{x:.3f}' for x in decode[n])})"
                  f"  prefill {args.prefill}: {np.median(prefill[n]):,.0f} tokens/s ({', '.join(f'{x:,.0f}' for x in prefill[n])})"
                  f"  {size / 1e6:.2f} MB", flush=True)


if __name__ == "__main__":
    main()
