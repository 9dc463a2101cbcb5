"""What an in-process export leaves held: anonymous memory of this process before, at the peak of, and after
``edgelin.exporters.export`` (Python API), the caller having dropped nothing but what export made.

    python scripts/export_memory.py CKPT [--precision fp32] [--out FILE]

Loads nothing itself: ``export(CKPT, a temporary folder)`` reads the checkpoint, so after it returns the process
should hold about what it held before (the libraries). RssAnon from /proc/self/status, sampled every 0.05 s on a
thread for the peak; "after" is read once ``gc.collect()`` has run. Linux only.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--out", type=Path, help="write the JSON record here")
    args = ap.parse_args()
    if not Path("/proc/self/status").exists():
        print("this script reads /proc/self/status (Linux)", file=sys.stderr)
        return 2
    from edgelin.exporters import export
    from edgelin.runtime.files import write_json

    before = rss_anon()
    peak, done = [before], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], rss_anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="edgelin-export-memory-") as tmp:
        export(args.checkpoint, Path(tmp) / "out", precision=args.precision)
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        gc.collect()
        after = rss_anon()
    weights = sum(p.stat().st_size for p in args.checkpoint.glob("*.safetensors"))
    record = {"checkpoint": str(args.checkpoint), "precision": args.precision, "checkpoint_bytes": weights, "export_s": seconds,
              "anon_before": before, "anon_peak": peak[0], "anon_after_return": after, "held_after_return": after - before}
    print(f"export {seconds:.0f} s; anonymous memory before {before / 1e9:.2f} GB, peak {peak[0] / 1e9:.2f} GB, "
          f"after it returned {after / 1e9:.2f} GB (held: {(after - before) / 1e9:.2f} GB; checkpoint {weights / 1e9:.2f} GB)")
    if args.out:
        print(f"wrote {write_json(args.out, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
