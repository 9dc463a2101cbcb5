"""`make gpu-check`: the bundled model on CUDA, fp32 and fp16, in one table.

For each precision: export the bundled model, run `edgelin validate --providers cpu,cuda` (CUDA vs CPU
and everything else validate checks) and the device-side `edgelin check --providers cpu,cuda` (both providers
against the export's golden outputs, CUDA against CPU), and time decode (batch 1 and 8) and prefill on the CUDA provider
through the runtime. Then run `edgelin bench --provider cuda` and `edgelin bench --provider cuda --section
precision` once each (their own exports) and point at their results. Nothing is reported for CUDA unless ONNX Runtime really activated the CUDA provider: on a
machine without a usable GPU the script says so and exits 1.

    python scripts/gpu_check.py [--out gpu-check] [--skip-bench]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "fp16")
DECODE_STEPS, WARMUP = 200, 20


def edgelin(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("edgelin")), *args]
    print("$ edgelin " + " ".join(args), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True)


def time_cuda(export_dir: Path) -> dict[str, float]:
    """Median decode ms/token at batch 1 and 8, and prefill tokens/s (batch 1, 1024 tokens), on CUDA."""
    from edgelin.runtime.session import Session

    session = Session(export_dir, provider="cuda")
    rng = np.random.default_rng(0)
    out = {}
    for batch in (1, 8):
        state = session.new_state(batch)
        ids = rng.integers(0, session.vocab_size, (batch, DECODE_STEPS + WARMUP))
        times = []
        for t in range(DECODE_STEPS + WARMUP):
            t0 = time.perf_counter()
            session.decode(ids[:, t : t + 1], state)
            times.append(time.perf_counter() - t0)
        out[f"decode_ms_b{batch}"] = float(np.median(times[WARMUP:]) * 1e3)
    ids = rng.integers(0, session.vocab_size, (1, 1024))
    session.prefill(ids, session.new_state(1))  # warm-up
    t0 = time.perf_counter()
    for _ in range(5):
        session.prefill(ids, session.new_state(1), last_only=True)
    out["prefill_tok_s"] = 5 * 1024 / (time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check", help="folder for the exports, reports and bench results")
    ap.add_argument("--skip-bench", action="store_true", help="do not run `edgelin bench --provider cuda`")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rows = []
    for precision in PRECISIONS:
        export_dir = out / f"export-{precision}"
        run = edgelin("export", "-o", str(export_dir), "--precision", precision, "--force")
        if run.returncode:
            print(run.stdout + run.stderr)
            return 2
        size = sum(p.stat().st_size for p in export_dir.iterdir() if p.suffix in (".onnx", ".data"))
        report = out / f"validate-{precision}.json"
        report.unlink(missing_ok=True)
        run = edgelin("validate", str(export_dir), "--providers", "cpu,cuda", "--json", str(report))
        print(run.stdout[-3000:] + run.stderr[-2000:])
        data = json.loads(report.read_text()) if report.is_file() else {}
        cuda_state = data.get("providers", {}).get("cuda", "not run")
        cuda_checks = [c for c in data.get("checks", []) if c["group"] == "providers" and c["name"].startswith("cuda:") and c["max_abs"] is not None]
        # the torch-free check a device runs: both providers against the golden outputs, CUDA against CPU
        golden_report = out / f"check-{precision}.json"
        golden_report.unlink(missing_ok=True)  # never read an earlier run's report as this one's
        run = edgelin("check", str(export_dir), "--providers", "cpu,cuda", "--json", str(golden_report))
        print(run.stdout[-3000:] + run.stderr[-1000:])
        golden_data = json.loads(golden_report.read_text()) if golden_report.is_file() else {}
        row = {"precision": precision, "size_mb": size / 1e6, "validate": "PASS" if data.get("passed") else "FAIL",
               "check": "PASS" if golden_data.get("passed") else "FAIL", "cuda": cuda_state,
               "cuda_vs_cpu_max_abs": max((c["max_abs"] for c in cuda_checks), default=None),
               "cuda_vs_cpu_max_rel": max((c["max_rel"] for c in cuda_checks if c.get("max_rel") is not None), default=None)}
        if cuda_state == "active":
            row.update(time_cuda(export_dir))
        rows.append(row)

    if not args.skip_bench:
        run = edgelin("bench", "--provider", "cuda", "--out", str(out / "bench"))
        print(run.stdout[-4000:] + run.stderr[-2000:])
        bench_note = f"bench: exit {run.returncode}, results in {out / 'bench'}"
        run = edgelin("bench", "--provider", "cuda", "--section", "precision", "--out", str(out / "bench-precision"))
        print(run.stdout[-3000:] + run.stderr[-1000:])
        bench_note += f"; bench --section precision: exit {run.returncode}, results in {out / 'bench-precision'}"
    else:
        bench_note = "bench: skipped"

    def cell(row, key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "not measured"

    print("\nprecision  size MB  validate  check  CUDA vs CPU max abs  decode ms b=1  decode ms b=8  prefill tok/s")
    for r in rows:
        print(f"{r['precision']:9s}  {r['size_mb']:7.2f}  {r['validate']:8s}  {r['check']:5s}  {cell(r, 'cuda_vs_cpu_max_abs', '{:.1e}'):19s}  "
              f"{cell(r, 'decode_ms_b1', '{:.3f}'):13s}  {cell(r, 'decode_ms_b8', '{:.3f}'):13s}  {cell(r, 'prefill_tok_s', '{:,.0f}')}")
    print(bench_note)
    (out / "gpu_check.json").write_text(json.dumps({"rows": rows, "bench": bench_note}, indent=2))
    if any(r["cuda"] != "active" for r in rows):
        print(f"CUDA was not active ({rows[0]['cuda']}): no CUDA figure was measured.")
        return 1
    return 0 if all(r["validate"] == "PASS" and r["check"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
