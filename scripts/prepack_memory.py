"""An export's resident memory and speed with ONNX Runtime's weight prepacking on and off, each in a fresh process.

    python scripts/prepack_memory.py EXPORT [--threads 2] [--prompt 512] [--steps 64] [--out FILE]

For each setting (off, then on), a child process loads ``edgelin.runtime.session.Session(EXPORT, "cpu", threads,
prepack=...)``, prefills a random prompt of ``--prompt`` ids in one call, then runs ``--steps`` greedy decode steps (after
4 warm-up steps from a fresh state): prefill tokens/s, decode tokens/s (median step), and the process's memory from
/proc/self (VmHWM, RssAnon: its own memory, what has to fit; RssFile: pages mapped from weights.data; Pss) after
loading and at the end. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
from edgelin.runtime.session import Session
folder, prepack, threads, length, steps = sys.argv[1], sys.argv[2] == "on", int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def memory():
    got = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            got[key] = int(value.split()[0]) * 1024
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            got["Pss"] = int(line.split()[1]) * 1024
    return got
t = time.perf_counter()
sess = Session(folder, "cpu", threads, session_options={"inter_op_num_threads": 1}, io_binding=True, prepack=prepack, check_hashes=False)
load_s, loaded = time.perf_counter() - t, memory()
prompt = np.random.default_rng(0).integers(0, sess.manifest.vocab_size, (1, length)).astype(np.int64)
def run(n):
    state = sess.new_state(1)
    t = time.perf_counter()
    logits = sess.prefill(prompt, state, last_only=True)
    prefill_s, times = time.perf_counter() - t, []
    for _ in range(n):
        t = time.perf_counter()
        logits = sess.decode(np.asarray([[int(logits[0].argmax())]], dtype=np.int64), state)[:, -1]
        times.append(time.perf_counter() - t)
    return prefill_s, times
run(4)
prefill_s, times = run(steps)
print(json.dumps({"prepack": prepack, "load_s": load_s, "loaded": loaded, "end": memory(), "prefill_tokens_per_s": length / prefill_s,
                  "decode_tokens_per_s": 1 / float(np.median(times))}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("export")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for setting in ("off", "on"):
        done = subprocess.run([sys.executable, "-c", CHILD, args.export, setting, str(args.threads), str(args.prompt), str(args.steps)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"prepack {setting}: the measuring process failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/prepack_memory.py " + " ".join(sys.argv[1:]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
