"""An export's peak memory, in memory against streamed: each export in a child process.

    python scripts/export_memory.py CKPT [CKPT ...] [--precision fp32] [--modes memory,streamed] [--no-check] [--keep DIR] [--out docs/bench/export_memory-streamed.json]

For each checkpoint folder, ``edgelin.exporters.export(CKPT, OUT, streamed=False)`` (the weights loaded into memory)
and then the default, streamed (the weights read one tensor at a time into a scratch file mapped back: edgelin.streaming),
each in a fresh child process: wall seconds, ru_maxrss (from wait4: the child's peak resident set, which counts the
pages it maps from files too: the scratch file, weights.data) and the peak RssAnon (sampled every 0.05 s from
/proc/PID/status: the process's own memory, what has to fit) and the peak growth of the disk's used space (the whole file
system's: run it when nothing else writes). Linux only. Build checkpoints of published shapes with
``python scripts/real_size.py`` (its builders) or any transformers folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = """
import sys
from edgelin.exporters import export
ckpt, out, precision, streamed, check = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "streamed", sys.argv[5] == "check"
print(export(ckpt, out, force=True, precision=precision, streamed=streamed, check=check).summary())
"""


def one(ckpt: str, mode: str, precision: str, work: Path, check: bool = True) -> dict:
    peak = [0]
    stop = threading.Event()

    disk0 = shutil.disk_usage(work).used
    disk = [0]

    def sample(pid: int) -> None:
        while not stop.wait(0.05):
            disk[0] = max(disk[0], shutil.disk_usage(work).used - disk0)
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("RssAnon:"):
                        peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            except OSError:
                return

    out = work / f"{Path(ckpt).name}-{mode}"
    t0 = time.perf_counter()
    with open(str(out) + ".log", "w") as log:
        child = subprocess.Popen([sys.executable, "-c", CHILD, ckpt, str(out), precision, mode, "check" if check else "no-check"], stdout=log, stderr=subprocess.STDOUT)
    watcher = threading.Thread(target=sample, args=(child.pid,), daemon=True)
    watcher.start()
    _, status, usage = os.wait4(child.pid, 0)
    stop.set()
    watcher.join()
    return {"checkpoint": ckpt, "mode": mode, "precision": precision, "check": check, "returncode": os.waitstatus_to_exitcode(status),
            "wall_s": round(time.perf_counter() - t0, 1), "ru_maxrss_MB": usage.ru_maxrss // 1024, "peak_anon_MB": peak[0] >> 20,
            "peak_disk_MB": disk[0] >> 20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--modes", default="memory,streamed", help="which of memory,streamed to run (default both)")
    ap.add_argument("--no-check", action="store_true", help="export without the smoke check (random weights fail int4's budget)")
    ap.add_argument("--keep", default=None, help="a folder to write the exports into and keep (default: a temporary one)")
    ap.add_argument("--out", default=None, help="a JSON record of the rows")
    args = ap.parse_args()
    rows = []
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="edgelin-export-memory-")) as tmp:
        for ckpt in args.checkpoints:
            for mode in args.modes.split(","):
                rows.append(one(ckpt, mode, args.precision, Path(tmp), check=not args.no_check))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python scripts/export_memory.py", *sys.argv[1:]]), "rows": rows},
                                             indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
