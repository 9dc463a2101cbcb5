"""An export's (or a validate's) peak memory, in memory against streamed: each run in a child process.

    python scripts/export_memory.py CKPT [CKPT ...] [--precision fp32] [--modes memory,streamed] [--no-check] [--keep DIR] [--out docs/bench/export_memory-streamed.json]
    python scripts/export_memory.py CKPT --validate EXPORT [--code OLD_TREE] [--steps 8] [--upstream off] [--out FILE]

For each checkpoint folder, ``edgelin.exporters.export(CKPT, OUT, streamed=False)`` (the weights loaded into memory)
and then the default, streamed (the weights read one tensor at a time into a scratch file mapped back: edgelin.streaming),
each in a fresh child process: wall seconds, ru_maxrss (from wait4: the child's peak resident set, which counts the
pages it maps from files too: the scratch file, weights.data) and the peak RssAnon (sampled every 0.05 s from
/proc/PID/status: the process's own memory, what has to fit) and the peak growth of the disk's used space (the whole file
system's: run it when nothing else writes). Linux only. Build checkpoints of published shapes with
``python scripts/shard_checkpoint.py`` or use any transformers folder.

With ``--validate EXPORT``: ``edgelin.validate.validate(EXPORT, CKPT, ...)`` instead (no 1k/16k KV check, no long
stream, the shortest held-out text), measured the same way; ``--code DIR`` runs it from another copy of edgelin's
package (a folder holding ``edgelin``, put first on PYTHONPATH: an earlier commit's tree, for a before/after).
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


VALIDATE = """
import json, sys
from edgelin.validate import validate
export, ckpt, steps, upstream, each_call = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "each-call"
if each_call:  # the float64 reference converted at every call whatever the memory available (edgelin.layerwise)
    import edgelin.layerwise
    edgelin.layerwise.fits_converted = lambda *args, **kwargs: False
report = validate(export, ckpt, steps=steps, kv=(), long=0, heldout_bytes=514, upstream=upstream)
print(report.table())
print(json.dumps({"passed": report.passed, "seconds": round(report.seconds, 1)}))
"""


def one(ckpt: str, mode: str, precision: str, work: Path, check: bool = True) -> dict:
    out = work / f"{Path(ckpt).name}-{mode}"
    row = measured([sys.executable, "-c", CHILD, ckpt, str(out), precision, mode, "check" if check else "no-check"], work, Path(str(out) + ".log"))
    return {"checkpoint": ckpt, "mode": mode, "precision": precision, "check": check, **row}


def measured(command: list[str], work: Path, log_path: Path, env: dict | None = None) -> dict:
    """Run ``command`` (its output to ``log_path``): its exit code, wall seconds, ru_maxrss, peak RssAnon and the peak
    growth of the used space of ``work``'s disk."""
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

    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)  # not this tree's folder: --code
    watcher = threading.Thread(target=sample, args=(child.pid,), daemon=True)
    watcher.start()
    _, status, usage = os.wait4(child.pid, 0)
    stop.set()
    watcher.join()
    return {"returncode": os.waitstatus_to_exitcode(status),
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
    ap.add_argument("--validate", default=None, metavar="EXPORT", help="measure validate of EXPORT against the checkpoint instead")
    ap.add_argument("--code", default=None, help="with --validate: a folder holding the edgelin package to run instead of this one")
    ap.add_argument("--steps", type=int, default=8, help="with --validate: its decode steps (default 8)")
    ap.add_argument("--upstream", default="off", help="with --validate: off, auto or required (default off)")
    ap.add_argument("--each-call", action="store_true", help="with --validate: the float64 reference converted one layer at a "
                    "time at every call even where a kept float64 model would fit (what a model too large for that gets)")
    args = ap.parse_args()
    rows = []
    if args.validate:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [args.code, os.environ.get("PYTHONPATH")]))) if args.code else None
        with tempfile.TemporaryDirectory(prefix="edgelin-validate-memory-") as tmp:
            log = Path(tmp) / "validate.log"
            row = measured([sys.executable, "-c", VALIDATE, args.validate, args.checkpoints[0], str(args.steps), args.upstream,
                             "each-call" if args.each_call else "kept"], Path(args.validate).resolve().parent, log, env)
            said = log.read_text().strip().splitlines()
        rows.append({"checkpoint": args.checkpoints[0], "export": args.validate, "code": args.code or "this tree", "steps": args.steps, "float64": "each call" if args.each_call else "as planned",
                     "upstream": args.upstream, **row, **(json.loads(said[-1]) if said and said[-1].startswith("{") else {"log_tail": said[-5:]}),
                     "report": said[:-1]})  # validate's table
        print(json.dumps(rows[-1]), flush=True)
    if args.validate and args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python scripts/export_memory.py", *sys.argv[1:]]), "rows": rows},
                                             indent=1) + "\n", encoding="utf-8")
        return
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="edgelin-export-memory-")) as tmp:
        for ckpt in [] if args.validate else args.checkpoints:
            for mode in args.modes.split(","):
                rows.append(one(ckpt, mode, args.precision, Path(tmp), check=not args.no_check))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(["python scripts/export_memory.py", *sys.argv[1:]]), "rows": rows},
                                             indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
