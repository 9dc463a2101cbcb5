"""Real-size models on this machine: export time and peak memory per precision, files, resident memory, speed, parity.

    python scripts/real_size.py lfm2-350m [--precisions fp32,int8,int4] [--threads 2] [--out docs/bench/real_size-lfm2-350m.json]

Builds a random-init checkpoint with the exact published configuration of the named model (transformers' or
fla's own classes, ``save_pretrained`` as safetensors; a checkpoint already in WORK/ckpt is used as it is: write one
too large to build in memory with ``scripts/shard_checkpoint.py``), then for each precision, each step in a child process:

- ``edgelin export CKPT -o OUT --precision P``: wall time and peak resident memory (the child's ru_maxrss, which
  counts the checkpoint's and the weights file's mapped pages too), peak anonymous memory (RssAnon, sampled
  every 0.1 s: what has to fit in memory) and the peak growth of the disk's used space (the file system's);
- the export's files on disk;
- a fresh process loads it with ``edgelin.runtime.load`` (ONNX Runtime, CPU, ``--threads``; once with ONNX
  Runtime's prepacking, the default, and once with ``prepack=False``): resident memory
  (Pss from /proc/self/smaps_rollup) after loading, then decode ms/token at batch 1 (median of 20 steps after
  5 warm-up steps) and prefill tokens/s at 1,024 and 4,096 tokens (``--prefill``; one ``prefill`` call, best of 2);
- ``edgelin validate OUT --checkpoint CKPT --steps 8 --kv 1024``: the verdict and the worst logits errors (a model
  with attention: its KV cache after 1,024 tokens against float64; the default's 16,384-token float64 run of a
  0.75 B model takes most of an hour here); fla models with ``--upstream off`` (fla's kernels run in Triton's CPU
  interpreter: hours at this size).

Random weights are not a trained model: quality measures (held-out bits/byte) do not apply, and the bundled
model's precision budgets were set on a trained model; the parity verdict is what the budgets say of these
weights. Linux only (it reads /proc). Needs transformers (and fla for the fla models).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from edgelin.bench.checkpoints import LFM2_350M, PUBLISHED  # the published configurations (text model only)

MODELS = {
    "lfm2-350m": PUBLISHED["lfm2-350m"],
    # LFM2-1.2B differs in width only: 1,170 M parameters
    "lfm2-1.2b": ("lfm2", {**LFM2_350M, "hidden_size": 2048, "num_attention_heads": 32, "intermediate_size": 12288, "block_ff_dim": 12288}),
    # fla's published training config (configs/gla_340M.json of fla's flame)
    "fla-gla-340m": ("gla", {
        "attn_mode": "chunk", "bos_token_id": 1, "clamp_min": None, "eos_token_id": 2, "expand_k": 0.5, "expand_v": 1,
        "fuse_cross_entropy": True, "fuse_norm": True, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 1024,
        "initializer_range": 0.006, "intermediate_size": None, "num_heads": 4, "num_hidden_layers": 24, "norm_eps": 1e-06,
        "tie_word_embeddings": True, "use_cache": True, "use_gk": True, "use_gv": False, "vocab_size": 32000,
    }),
    "qwen3.5-0.8b": PUBLISHED["qwen3.5-0.8b"],
    # too large to build in memory here: write the checkpoint first with scripts/shard_checkpoint.py into WORK/ckpt
    "qwen3.5-4b": PUBLISHED["qwen3.5-4b"],
    "qwen3.5-9b": PUBLISHED["qwen3.5-9b"],
}

FLA_MODEL_TYPES = {"gla"}  # built with flash-linear-attention's classes (fla registers them with transformers' Auto classes)

BUILD = textwrap.dedent(
    """
    import json, sys, time
    model_type, config, folder, kit = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    if kit == "fla":
        import fla  # noqa: F401
    else:
        sys.modules["fla"] = None  # transformers' own PyTorch paths
    import torch, transformers
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()), "build_s": time.perf_counter() - t}))
    """
)

MEASURE = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from edgelin.runtime import load
    folder, threads, prepack, lengths = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "on", [int(x) for x in sys.argv[4].split(",")]

    def pss():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024

    t = time.perf_counter()
    session = load(folder, provider="cpu", threads=threads, prepack=prepack)
    load_s, loaded = time.perf_counter() - t, pss()
    rng = np.random.default_rng(0)
    V = session.manifest.vocab_size
    state = session.new_state(1)
    session.prefill(rng.integers(0, V, (1, 16)), state)
    steps = []
    for i in range(25):
        tok = rng.integers(0, V, (1, 1))
        t = time.perf_counter()
        session.decode(tok, state)
        steps.append(time.perf_counter() - t)
    prefill = {}
    for T in lengths:
        best = float("inf")
        for _ in range(2):
            ids = rng.integers(0, V, (1, T))
            st = session.new_state(1)
            t = time.perf_counter()
            session.prefill(ids, st, last_only=True)
            best = min(best, time.perf_counter() - t)
        prefill[str(T)] = T / best
    print(json.dumps({"load_s": load_s, "pss_loaded": loaded, "pss_after": pss(), "decode_ms": 1e3 * float(np.median(steps[5:])),
                      "prefill_tok_s": prefill}))
    """
)


# the CLI of the Python running this script (its environment's, whether or not it is on PATH)
EDGELIN = [sys.executable, "-c", "import sys; from edgelin.cli import main; sys.exit(main())"]

PEAK_ANON: dict[int, int] = {}  # child pid -> the largest RssAnon sampled
PEAK_DISK: dict[int, int] = {}  # child pid -> the largest growth of the work folder's file system's used bytes


def _sample_anon(pid: int, stop: threading.Event, disk: Path) -> None:
    """Anonymous resident memory of ``pid`` every 0.1 s: ru_maxrss also counts file pages mapped from the
    checkpoint and the weights file, which the kernel can drop; RssAnon is what must fit in memory. Also the growth
    of the used space of ``disk``'s file system since the child started (the whole file system's: run it when
    nothing else writes)."""
    start = shutil.disk_usage(disk).used
    while not stop.wait(0.1):
        PEAK_DISK[pid] = max(PEAK_DISK.get(pid, 0), shutil.disk_usage(disk).used - start)
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("RssAnon:"):
                    PEAK_ANON[pid] = max(PEAK_ANON.get(pid, 0), int(line.split()[1]) * 1024)
        except OSError:
            return


def run_child(args: list[str], log: Path) -> tuple[int, float, int]:
    """(exit status, wall seconds, peak resident bytes) of one child process, its output to ``log``; its peak
    anonymous memory is left in ``PEAK_ANON[pid]`` (``last_peak_anon()``)."""
    global _LAST_PID
    with open(log, "w") as out:
        t = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_anon, args=(proc.pid, stop, log.parent), daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        stop.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    _LAST_PID = proc.pid
    return proc.returncode, time.perf_counter() - t, usage.ru_maxrss * 1024


_LAST_PID = 0


def last_peak_anon() -> int:
    return PEAK_ANON.get(_LAST_PID, 0)


def killed_by(code: int) -> str:
    """What a child's non-zero exit status says, as the start of a record's line."""
    return f"killed by signal {-code} (SIGKILL: the kernel's out-of-memory killer, as a rule) during: " if code < 0 else "error: "


def last_peak_disk() -> int:
    return PEAK_DISK.get(_LAST_PID, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="keep the checkpoint and exports here [default: a temporary folder]")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    ap.add_argument("--validate-prepack", choices=("on", "off"), default="on",
                    help="validate's CPU session with ONNX Runtime's prepacking (on, the runtime's default) or with the weights read "
                         "in place (off: one copy of the weights fewer beside the float64 model; LFM2-1.2B needs it on 24 GB)")
    ap.add_argument("--budget", action="append", default=[], metavar="KIND.BOUND=VALUE",
                    help="a parity bound of this model's own for the export's smoke check and for validate (edgelin export/validate "
                         "--budget), e.g. for random weights whose fp32 forward is itself that far from float64; recorded")
    ap.add_argument("--prefill", default="1024,4096", help="prompt lengths of the prefill figures (comma-separated) [default: 1024,4096]")
    ap.add_argument("--prepack", default="on,off", help="ONNX Runtime's prepacking in the measuring sessions: on, off or both [default: on,off]")
    ap.add_argument("--no-check", action="store_true", help="export without the smoke check (run `edgelin check` on the export instead)")
    ap.add_argument("--skip-validate", action="store_true", help="export and measure only (validate holds the checkpoint in fp32 and "
                    "float64 beside the sessions: about 7x the weights)")
    args = ap.parse_args()
    if not Path("/proc/self/smaps_rollup").exists():
        print("this script reads /proc/self/smaps_rollup (Linux)", file=sys.stderr)
        return 2
    model_type, config = MODELS[args.model]
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        ckpt = work / "ckpt"
        record = {"model": args.model, "model_type": model_type, "config": config, "threads": args.threads, "budget": args.budget,
                  "machine": os.uname().machine,
                  "cpus": os.cpu_count(), "rows": []}
        if not (ckpt / "config.json").exists():
            print(f"building a random-init {args.model} ({model_type}) ...", flush=True)
            code, seconds, peak = run_child([sys.executable, "-c", BUILD, model_type, json.dumps(config), str(ckpt),
                                                  "fla" if model_type in FLA_MODEL_TYPES else "transformers"], work / "build.log")
            if code:
                print((work / "build.log").read_text()[-3000:], file=sys.stderr)
                return 1
            built = json.loads((work / "build.log").read_text().strip().splitlines()[-1])
            record.update(params=built["params"], build_s=seconds, build_peak_rss=peak)
            print(f"  {built['params'] / 1e6:,.1f} M parameters in {seconds:.0f} s (peak {peak / 1e9:.2f} GB)", flush=True)
        record["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.iterdir())
        if "params" not in record:  # a checkpoint built by an earlier run: counted from the safetensors headers
            from edgelin.checkpoint import weight_files
            from edgelin.safety import header_shapes

            record["params"] = sum(math.prod(shape) for f in weight_files(ckpt) for shape in header_shapes(f).values())
        for precision in args.precisions.split(","):
            out = work / f"export-{precision}"
            row = {"precision": precision}
            print(f"{precision}: exporting ...", flush=True)
            code, seconds, peak = run_child([*EDGELIN, "export", str(ckpt), "-o", str(out), "--precision", precision, "--force",
                                             *(f"--budget={b}" for b in args.budget), *(["--no-check"] if args.no_check else [])],
                                            work / f"export-{precision}.log")
            row.update(export_s=seconds, export_peak_rss=peak, export_peak_anon=last_peak_anon(), export_disk_peak_growth=last_peak_disk(),
                       export_ok=code == 0, export_check=not args.no_check)
            if code:
                row["error"] = (work / f"export-{precision}.log").read_text().strip().splitlines()[-1][:500]
                print(f"  export failed: {row['error']}", flush=True)
                record["rows"].append(row)
                continue
            row["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
            print(f"  {seconds:.0f} s, peak {peak / 1e9:.2f} GB (anonymous {row['export_peak_anon'] / 1e9:.2f} GB), "
                  f"disk's peak growth {row['export_disk_peak_growth'] / 1e9:.1f} GB, "
                  f"on disk {sum(row['files'].values()) / 1e6:,.0f} MB; measuring ...", flush=True)
            for prepack in args.prepack.split(","):  # ONNX Runtime's default (packed copies per session), then the file's pages
                log = work / f"measure-{precision}-prepack-{prepack}.log"
                code, _, _ = run_child([sys.executable, "-c", MEASURE, str(out), str(args.threads), prepack, args.prefill], log)
                if code:
                    row[f"measure_error_prepack_{prepack}"] = (killed_by(code) + log.read_text()[-1000:]
                                                               + f" (own memory at the end: {last_peak_anon() / 1e9:.2f} GB)")
                    print(f"  prepack {prepack}: {row[f'measure_error_prepack_{prepack}']}", flush=True)
                    continue
                got = json.loads(log.read_text().strip().splitlines()[-1])
                if prepack == "on":
                    row.update(got)
                else:
                    row["prepack_off"] = got
                print(f"  prepack {prepack}: resident {got['pss_loaded'] / 1e9:.2f} GB loaded, {got['pss_after'] / 1e9:.2f} GB after prefill, "
                      f"decode {got['decode_ms']:.1f} ms/token, prefill " + ", ".join(f"{k}: {v:,.0f} tok/s" for k, v in got["prefill_tok_s"].items()),
                      flush=True)
            if args.skip_validate:
                row["parity"] = "not run (--skip-validate)"
                record["rows"].append(row)
                continue
            report = work / f"validate-{precision}.json"
            # fla's own model runs its Triton kernels in the CPU interpreter: hours at this size, so not here
            report.unlink(missing_ok=True)  # an earlier run's report must not stand for this one (a killed validate writes none)
            upstream = ["--upstream", "off"] if model_type in FLA_MODEL_TYPES else []
            row["validate_upstream"] = not upstream
            code, seconds, _ = run_child([*EDGELIN, "validate", str(out), "--checkpoint", str(ckpt), "--steps", "8", "--kv", "1024",
                                          "--json", str(report), "--force", *upstream,
                                          *(["--no-prepack"] if args.validate_prepack == "off" else []),
                                          *(f"--budget={b}" for b in args.budget)], work / f"validate-{precision}.log")
            row.update(validate_prepack=args.validate_prepack, validate_exit=code)
            row["validate_s"] = seconds
            if report.exists():
                data = json.loads(report.read_text())
                numeric = [c for c in data["checks"] if c.get("max_rel") is not None]
                row.update(parity="PASS" if data["passed"] else "FAIL", worst_max_rel=max((c["max_rel"] for c in numeric), default=None),
                           worst_rel_l2=max((c["rel_l2"] for c in numeric), default=None),
                           failed=[f"{c['group']}/{c['name']}" for c in data["checks"] if c["status"] == "fail"])
            else:
                row["parity"] = killed_by(code) + (work / f"validate-{precision}.log").read_text().strip().splitlines()[-1][:300]
            print(f"  validate: {row['parity']} ({seconds:.0f} s)", flush=True)
            record["rows"].append(row)
        if args.out:
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\n{'precision':9s} {'export s':>8s} {'peak GB':>8s} {'disk MB':>8s} {'resident GB':>11s} {'decode ms':>9s} "
          f"{'prefill 1k':>10s} {'prefill 4k':>10s}  parity")
    for r in record["rows"]:
        if not r.get("export_ok"):
            print(f"{r['precision']:9s} export failed: {r.get('error')}")
            continue
        p = r.get("prefill_tok_s", {})
        print(f"{r['precision']:9s} {r['export_s']:8.0f} {r['export_peak_rss'] / 1e9:8.2f} {sum(r['files'].values()) / 1e6:8,.0f} "
              f"{r.get('pss_after', 0) / 1e9:11.2f} {r.get('decode_ms', float('nan')):9.1f} {p.get('1024', 0):10,.0f} {p.get('4096', 0):10,.0f}  "
              f"{r.get('parity')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
