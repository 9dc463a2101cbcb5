"""How long `edgelin export` takes with and without the exporter's changes to torch.onnx's own steps.

    python scripts/export_time.py CKPT [--rounds 2] [--precision fp32] [--out FILE]
    python scripts/export_time.py --build qwen3.5-0.8b --hidden 256 --vocab 4096 --intermediate 512 WORK_DIR ...

Each export is `edgelin export CKPT -o ... --force` in a child process, as a user runs it, timed wall to wall:
"now" as edgelin exports, "without" with ``exporters.exporter._rewriter_prefilter`` and ``_tracer_settings``
replaced by no-ops (onnxscript's rewriter walking the whole graph at every node; torch's fake-tensor cache on).
Rounds alternate which goes first. With ``--build MODEL`` a random-init checkpoint of one of
``scripts/real_size.py``'s published configurations is built first into WORK_DIR/ckpt (transformers' own
classes), its widths optionally reduced (``--hidden``, ``--vocab``, ``--intermediate``): the layers, heads and head
sizes stay as published, so the graphs have the real model's nodes. The two exports' graphs are compared node by
node (op types, in order). Needs transformers for ``--build``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_size  # noqa: E402  (scripts/real_size.py: the published configurations)

WITHOUT = ("import contextlib, edgelin.exporters.exporter as ex; "
           "ex._rewriter_prefilter = ex._tracer_settings = contextlib.nullcontext; ")
CLI = "import sys; {patch}from edgelin.cli import main; sys.exit(main())"


def build(model: str, work: Path, hidden: int | None, vocab: int | None, intermediate: int | None) -> tuple[Path, dict]:
    model_type, config = real_size.MODELS[model]
    changes = {k: v for k, v in (("hidden_size", hidden), ("vocab_size", vocab), ("intermediate_size", intermediate)) if v}
    config = {**config, **changes}
    if "block_ff_dim" in config and intermediate:
        config["block_ff_dim"] = intermediate
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        print(f"building a random-init {model} ({model_type}) {changes or ''} ...", flush=True)
        kit = "fla" if model_type in real_size.FLA_MODEL_TYPES else "transformers"
        done = subprocess.run([sys.executable, "-c", real_size.BUILD, model_type, json.dumps(config), str(ckpt), kit],
                              capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(1)
    return ckpt, {"model": model, "model_type": model_type, "changes": changes}


def export_once(ckpt: Path, out: Path, precision: str, without: bool, log: Path) -> float:
    code = CLI.format(patch=WITHOUT if without else "")
    start = time.perf_counter()
    with open(log, "w") as sink:
        done = subprocess.run([sys.executable, "-c", code, "export", str(ckpt), "-o", str(out), "--precision", precision,
                               "--force"], stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"export failed ({'without' if without else 'now'}): see {log}")
    return seconds


def ops(folder: Path) -> dict[str, list[str]]:
    return {g: [n.op_type for n in onnx.load(str(folder / f"{g}.onnx"), load_external_data=False).graph.node]
            for g in ("prefill", "decode")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path, help="the checkpoint; with --build, the work folder")
    ap.add_argument("--build", choices=sorted(real_size.MODELS), help="build this scripts/real_size.py model into PATH/ckpt first")
    ap.add_argument("--hidden", type=int, help="with --build: hidden size instead of the published one")
    ap.add_argument("--vocab", type=int, help="with --build: vocabulary size instead of the published one")
    ap.add_argument("--intermediate", type=int, help="with --build: MLP width instead of the published one")
    ap.add_argument("--rounds", type=int, default=2, help="pairs of exports, alternating which goes first [2]")
    ap.add_argument("--precision", default="fp32", help="edgelin export --precision [fp32]")
    ap.add_argument("--out", type=Path, help="write the JSON record here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not args.build and not (args.path / "config.json").exists():
        ap.error(f"{args.path} is not a checkpoint folder (no config.json): pass one, or --build MODEL with a work folder")
    record: dict = {"precision": args.precision, "rounds": []}
    if args.build:
        work = args.path
        work.mkdir(parents=True, exist_ok=True)
        ckpt, record["built"] = build(args.build, work, args.hidden, args.vocab, args.intermediate)
    else:
        ckpt, work = args.path, Path(args.path).parent / (Path(args.path).name + "-export-time")
        work.mkdir(exist_ok=True)
    record["checkpoint"] = str(ckpt)
    for r in range(args.rounds):
        order = ("without", "now") if r % 2 == 0 else ("now", "without")
        row = {"order": list(order)}
        for which in order:
            out = work / f"export-{which}"
            print(f"round {r + 1}: exporting ({which}) ...", flush=True)
            row[which] = export_once(ckpt, out, args.precision, which == "without", work / f"export-{which}-{r + 1}.log")
            print(f"  {row[which]:.1f} s", flush=True)
        row["ratio"] = row["without"] / row["now"]
        record["rounds"].append(row)
    graphs_now, graphs_without = ops(work / "export-now"), ops(work / "export-without")
    record["same_ops"] = graphs_now == graphs_without
    record["nodes"] = {g: len(v) for g, v in graphs_now.items()}
    for row in record["rounds"]:
        print(f"without {row['without']:.1f} s, now {row['now']:.1f} s: {row['ratio']:.2f}x ({' then '.join(row['order'])})")
    print(f"graphs: {record['nodes']['prefill']} + {record['nodes']['decode']} nodes; "
          f"the same op types in the same order: {record['same_ops']}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if record["same_ops"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
