"""An export's peak memory, in memory against streamed: each export in a child process.

    python scripts/export_memory.py CKPT [CKPT ...] [--precision fp32] [--modes memory,streamed] [--out docs/bench/export_memory-streamed.json]

For each checkpoint folder, ``edgelin.exporters.export(CKPT, OUT, streamed=False)`` (the weights loaded into memory)
and then the default, streamed (the weights read one tensor at a time into a scratch file mapped back: edgelin.streaming),
each in a fresh child process: wall seconds, ru_maxrss (from wait4: the child's peak resident set, which counts the
pages it maps from files too: the scratch file, weights.data) and the peak RssAnon (sampled every 0.05 s from
/proc/PID/status: the process's own memory, what has to fit). Linux only. Build checkpoints of published shapes with
``python scripts/real_size.py`` (its builders) or any transformers folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = """
import sys
from edgelin.exporters import export
ckpt, out, precision, streamed = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "streamed"
print(export(ckpt, out, force=True, precision=precision, streamed=streamed).summary())
"""


def one(ckpt: str, mode: str, precision: str, work: Path) -> dict:
    peak = [0]
    stop = threading.Event()

    def sample(pid: int) -> None:
        while not stop.wait(0.05):
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                return

    out = work / f"{Path(ckpt).name}-{mode}"
    t0 = time.perf_counter()
    with open(str(out) + ".log", "w") as log:
        child = subprocess.Popen([sys.executable, "-c", CHILD, ckpt, str(out), precision, mode], stdout=log, stderr=subprocess.STDOUT)
    watcher = threading.Thread(target=sample, args=(child.pid,), daemon=True)
    watcher.start()
    _, status, usage = os.wait4(child.pid, 0)
    stop.set()
    watcher.join()
    return {"checkpoint": ckpt, "mode": mode, "precision": precision, "returncode": os.waitstatus_to_exitcode(status),
            "wall_s": round(time.perf_counter() - t0, 1), "ru_maxrss_MB": usage.ru_maxrss // 1024, "peak_anon_MB": peak[0] >> 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--modes", default="memory,streamed", help="which of memory,streamed to run (default both)")
    ap.add_argument("--out", default=None, help="a JSON record of the rows")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgelin-export-memory-") as tmp:
        for ckpt in args.checkpoints:
            for mode in args.modes.split(","):
                rows.append(one(ckpt, mode, args.precision, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python scripts/export_memory.py", *sys.argv[1:]]), "rows": rows},
                                             indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
