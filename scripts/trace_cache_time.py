"""One checkpoint exported in several precisions, each tracing on its own against all of them sharing a trace cache.

    python scripts/trace_cache_time.py CKPT WORK_DIR [--precisions fp32,int8,int4] [--rounds 2] [--no-check] [--out FILE]

Every export is `edgelin export CKPT -o ... --precision P` in a child process, as a user runs it, timed wall to
wall. "traced each time": no trace cache. "one trace cache": `--trace-cache WORK_DIR/traces-N`, empty at the
start of the round, so its first export traces and keeps the graphs and the others take them. Rounds alternate
which way goes first. The two ways' exports of each precision are compared file by file (sha256): they must be
the same bytes. WORK_DIR is made if missing and holds the exports and caches (delete it afterwards).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

CLI = "import sys; from edgelin.cli import main; sys.exit(main())"


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def export_once(ckpt: Path, out: Path, precision: str, cache: Path | None, log: Path, check: bool) -> float:
    args = [sys.executable, "-c", CLI, "export", str(ckpt), "-o", str(out), "--precision", precision, "--force"]
    if not check:
        args.append("--no-check")
    if cache is not None:
        args += ["--trace-cache", str(cache)]
    start = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run(args, stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"export failed ({log}):\n{log.read_text()[-2000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("work", type=Path)
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-check", action="store_true", help="export with --no-check (random weights can miss int4's smoke budget)")
    ap.add_argument("--out", type=Path, default=None, help="write the record (JSON) here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, not {args.rounds}")
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"{args.checkpoint} is not a checkpoint folder (no config.json)")
    precisions = [p for p in args.precisions.split(",") if p]
    args.work.mkdir(parents=True, exist_ok=True)
    rounds = []
    for r in range(args.rounds):
        order = ["each", "cache"] if r % 2 == 0 else ["cache", "each"]
        got: dict[str, dict] = {}
        for way in order:
            cache = None if way == "each" else args.work / f"traces-{r}"
            seconds = {}
            for p in precisions:
                out = args.work / f"{way}-{p}"
                seconds[p] = round(export_once(args.checkpoint, out, p, cache, args.work / f"{way}-{p}.log", not args.no_check), 1)
                print(f"round {r + 1} {way:5s} {p}: {seconds[p]:.1f} s", flush=True)
            got[way] = {"seconds": seconds, "total": round(sum(seconds.values()), 1),
                        "files": {p: digest(args.work / f"{way}-{p}") for p in precisions}}
        same = {p: got["each"]["files"][p] == got["cache"]["files"][p] for p in precisions}
        print(f"round {r + 1}: traced each time {got['each']['total']:.1f} s, one trace cache {got['cache']['total']:.1f} s "
              f"({got['each']['total'] / got['cache']['total']:.2f}x); same bytes: {same}", flush=True)
        rounds.append({"order": order, "each": {k: v for k, v in got["each"].items() if k != "files"},
                       "cache": {k: v for k, v in got["cache"].items() if k != "files"}, "same_bytes": same})
        if not all(same.values()):
            print("the exports differ: the trace cache gave other graphs", file=sys.stderr)
            return 1
    record = {"checkpoint": str(args.checkpoint), "precisions": precisions, "check": not args.no_check, "rounds": rounds}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
