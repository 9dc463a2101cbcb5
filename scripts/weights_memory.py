"""What storing the weights once buys, measured: disk, export peak memory, resident memory of a loaded export.

    python scripts/weights_memory.py [--d-model 1024 --layers 6 --vocab 32000] [--out DIR]

Exports a random-init LinearLM of the given size (fp32) with ``edgelin export``'s code, in a child process
whose peak resident memory is read from the kernel, then loads the export in fresh child processes and reads
their memory (``/proc/self/smaps_rollup``: Rss, and Pss split into file-backed and anonymous pages) after
loading both graphs and after a 64-token prefill and 30 decode steps:

- ``shared file``: the export as written (both graphs' initializers reference one ``weights.data``);
- ``inline``: the same graphs with their weights copied inside each graph file (every export before the
  weights file), written to a scratch folder;

each with ONNX Runtime's weight prepacking on (its default) and off (``session.disable_prepacking``). Linux only.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

EXPORT = textwrap.dedent(
    """
    import json, sys, time, resource, torch
    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM
    from edgelin.exporters import export
    d, layers, vocab, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=d // 64, head_dim=64, feature_map="relu",
                      decay="scalar", conv_size=4)
    model = LinearLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    t = time.perf_counter()
    r = export(model, out, check=False)
    print(json.dumps({"params": params, "export_s": time.perf_counter() - t, "files": r.files}))
    """
)

LOAD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, onnxruntime as ort
    folder, prepack = sys.argv[1], sys.argv[2] == "1"

    def memory():
        got = {}
        for line in open("/proc/self/smaps_rollup"):
            key, value = line.split(":", 1)
            if key in ("Rss", "Pss", "Pss_File", "Pss_Anon"):
                got[key] = int(value.split()[0]) * 1024
        return got

    m = json.load(open(f"{folder}/edgelin.json"))
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    before = memory()
    t = time.perf_counter()
    s = {g: ort.InferenceSession(f"{folder}/{f}", so, providers=["CPUExecutionProvider"]) for g, f in m["graphs"].items()}
    load_s = time.perf_counter() - t
    loaded = memory()
    state = {x["input"]: np.full([1] + x["shape"][1:], x["init"], np.float32) for x in m["states"]}
    outs = [m["logits"]] + [x["output"] for x in m["states"]]
    r = s["prefill"].run(outs, {m["input_ids"]: (np.arange(64, dtype=np.int64) % 97)[None], **state})
    state = dict(zip(state, r[1:]))
    steps = []
    for _ in range(30):
        tok = np.array([[int(r[0][0, -1].argmax())]])
        t = time.perf_counter()
        r = s["decode"].run(outs, {m["input_ids"]: tok, **state})
        steps.append(time.perf_counter() - t)
        state = dict(zip(state, r[1:]))
    print(json.dumps({"load_s": load_s, "before": before, "loaded": loaded, "ran": memory(),
                      "decode_ms": 1e3 * float(np.median(steps[5:])), "last_token": int(tok[0, 0])}))
    """
)


def inline_copy(export_dir: Path, dest: Path) -> None:
    """The export's graphs with their weights inside each graph file (the layout before the weights file)."""
    import onnx

    dest.mkdir()
    m = json.loads((export_dir / "edgelin.json").read_text())
    for f in m["graphs"].values():
        onnx.save(onnx.load(str(export_dir / f)), str(dest / f))
    shutil.copy(export_dir / "edgelin.json", dest / "edgelin.json")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON record here")
    args = ap.parse_args()
    if not Path("/proc/self/smaps_rollup").exists():
        print("this script reads /proc/self/smaps_rollup (Linux)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        export_dir = tmp / "export"
        print(f"exporting a LinearLM d_model {args.d_model}, {args.layers} layers, vocabulary {args.vocab:,} ...", flush=True)
        proc = subprocess.run([sys.executable, "-c", EXPORT, str(args.d_model), str(args.layers), str(args.vocab), str(export_dir)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        record["export_peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        weights = record["files"]["weights.data"]
        print(f"  {record['params'] / 1e6:.1f} M parameters, exported in {record['export_s']:.0f} s, peak resident "
              f"{record['export_peak_rss'] / 1e9:.2f} GB; files: " + ", ".join(f"{k} {v / 1e6:,.1f} MB" for k, v in record["files"].items()))
        inline_copy(export_dir, tmp / "inline")
        record["inline_files"] = {p.name: p.stat().st_size for p in sorted((tmp / "inline").iterdir())}
        rows = []
        print(f"{'layout':12s} {'prepack':8s} {'load s':>7s} {'Pss loaded':>11s} {'Pss after':>10s} {'of which file':>14s} "
              f"{'anon':>8s} {'decode ms':>10s}   (weights {weights / 1e6:,.1f} MB)")
        for layout, folder in (("shared file", export_dir), ("inline", tmp / "inline")):
            for prepack in (True, False):
                run = subprocess.run([sys.executable, "-c", LOAD, str(folder), "1" if prepack else "0"], capture_output=True, text=True)
                if run.returncode:
                    print(run.stderr[-2000:], file=sys.stderr)
                    return 1
                r = json.loads(run.stdout)
                r.update(layout=layout, prepack=prepack)
                rows.append(r)
                ran = r["ran"]
                print(f"{layout:12s} {'on' if prepack else 'off':8s} {r['load_s']:7.2f} {r['loaded']['Pss'] / 1e6:9.0f} MB "
                      f"{ran['Pss'] / 1e6:8.0f} MB {ran['Pss_File'] / 1e6:12.0f} MB {ran['Pss_Anon'] / 1e6:6.0f} MB {r['decode_ms']:10.2f}")
        if len({r["last_token"] for r in rows}) != 1:
            print("the layouts decoded different tokens", file=sys.stderr)
            return 1
        record["loads"] = rows
        if args.out:
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
