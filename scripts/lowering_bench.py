"""Portable vs fused graphs (``edgelin export --ops portable|fused``), per runtime, in one run.

    python scripts/lowering_bench.py [--threads 1] [--rounds 3] [--lengths 1024 4096 16384] [--out docs/bench/lowering.json]

Models (speed does not depend on the weights; each exported both ways, smoke-checked): the bundled model (relu map
with the denominator, a per-head decay, a short conv), and two LinearLMs of its size (d_model 256, 4 layers, 4 heads
x 64, conv 4, vocabulary 256, seed 0): GLA's per-feature decay ("gla") and Gated DeltaNet ("gdn": the delta rule
with a per-head gate).

Runtimes, each in one process with the two lowerings interleaved (order swapped every round; the figure is the
median over rounds):
    python   edgelin's Python runtime (ONNX Runtime CPU): decode ms per token at batch 1 and 8 (100 steps, the
             state fed back), prefill tokens/s of one prompt per length (``Session.prefill``: one call of T tokens)
    node     runtime/web/edgelin.mjs on onnxruntime-node (native CPU), batch 1        (scripts/lowering_bench.mjs)
    wasm     runtime/web/edgelin.mjs on onnxruntime-web's WASM backend under node, batch 1: the kernels a
             browser runs with the wasm execution provider (not measured inside Chromium)
Nodes per layer: the decode graph as ONNX Runtime runs it (after its load-time fusions), divided by the layers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "gla": {"feature_map": "elu+1", "decay": "gla"},
    "gdn": {"feature_map": "identity", "normalisation": "none", "update": "delta", "decay": "scalar"},
}
SIZE = {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64, "chunk_size": 64, "conv_size": 4}
DECODE_STEPS = 100
LOWERINGS = ("portable", "fused")


def exports(work: Path, say) -> dict[str, dict[str, Path]]:
    import torch

    from edgelin.config import ModelConfig
    from edgelin.exporters import export
    from edgelin.model import LinearLM
    from edgelin.models import bundled_checkpoint

    sources = {"bundled": bundled_checkpoint()}
    for name, options in MODELS.items():
        torch.manual_seed(0)
        sources[name] = LinearLM(ModelConfig(**SIZE, **options)).eval()
    out = {}
    for name, source in sources.items():
        for ops in LOWERINGS:
            say(f"exporting {name} ({ops}) ...")
            out.setdefault(name, {})[ops] = export(source, work / f"{name}-{ops}", ops=ops).out_dir
    return out


def python_runtime(folders: dict[str, Path], threads: int, rounds: int, lengths: list[int]) -> dict[str, float]:
    from edgelin.runtime import load

    sessions = {ops: load(folder, provider="cpu", threads=threads) for ops, folder in folders.items()}
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        for ops in (LOWERINGS if r % 2 == 0 else LOWERINGS[::-1]):
            session = sessions[ops]
            for batch in (1, 8):
                state = session.new_state(batch)
                session.decode(np.zeros((batch, 1), np.int64), state)  # warm
                start = time.perf_counter()
                for i in range(DECODE_STEPS):
                    session.decode(np.full((batch, 1), i % 256, np.int64), state)
                times.setdefault(f"{ops}/decode_b{batch}_ms", []).append((time.perf_counter() - start) / DECODE_STEPS * 1e3)
            for T in lengths:
                state = session.new_state(1)
                ids = rng.integers(0, 256, (1, T))
                start = time.perf_counter()
                session.prefill(ids, state, last_only=True)
                times.setdefault(f"{ops}/prefill_{T}_tok_s", []).append(T / (time.perf_counter() - start))
    return {key: float(np.median(values)) for key, values in times.items()}


def js_runtime(package: str, folders: dict[str, Path], threads: int, rounds: int, lengths: list[int]) -> dict:
    node = shutil.which("node")
    if node is None or not (ROOT / "node_modules" / package).exists():
        return {"status": "skipped", "reason": f"node or node_modules/{package} is missing (npm ci)"}
    done = subprocess.run([node, str(ROOT / "scripts" / "lowering_bench.mjs"), package, str(folders["portable"]), str(folders["fused"]),
                           str(threads), str(rounds), *map(str, lengths)], capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if done.returncode != 0:
        return {"status": "failed", "reason": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])["medians"]


def nodes_per_layer(folder: Path, layers: int, work: Path) -> float:
    from edgelin.bench.measure import node_counts

    return node_counts(folder / "decode.onnx", work)["as_run"] / layers


def table(record: dict) -> str:
    lines = []
    for model, row in record["models"].items():
        lines.append(f"{model}: nodes per layer as run, portable {row['nodes_per_layer']['portable']:.2f}, fused {row['nodes_per_layer']['fused']:.2f}")
        for runtime, medians in row["runtimes"].items():
            if "status" in medians:
                lines.append(f"  {runtime:7s} {medians['status']}: {medians['reason']}")
                continue
            for metric in sorted({k.split("/", 1)[1] for k in medians}):
                p, f = medians[f"portable/{metric}"], medians[f"fused/{metric}"]
                speedup = p / f if metric.endswith("_ms") else f / p
                lines.append(f"  {runtime:7s} {metric:22s} portable {p:10.3f}  fused {f:10.3f}  fused speed-up x{speedup:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--runtimes", nargs="+", default=["python", "node", "wasm"], choices=["python", "node", "wasm"])
    parser.add_argument("--out", type=Path, default=None, help="write the record here (JSON)")
    args = parser.parse_args(argv)

    from edgelin.bench.measure import load_average, machine_facts
    from edgelin.runtime.files import write_json

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="edgelin-lowering-") as tmp:
        work = Path(tmp)
        folders = exports(work, say)
        record = {"format": "edgelin-lowering/1", "threads": args.threads, "rounds": args.rounds, "lengths": args.lengths,
                  "machine": machine_facts(), "load_average_start": load_average(), "models": {}}
        for model, pair in folders.items():
            layers = json.loads((pair["portable"] / "edgelin.json").read_text())["model"].get("n_layers", 4)
            row = {"nodes_per_layer": {ops: nodes_per_layer(folder, layers, work) for ops, folder in pair.items()}, "runtimes": {}}
            for runtime in args.runtimes:
                say(f"timing {model} in {runtime} ...")
                if runtime == "python":
                    row["runtimes"][runtime] = python_runtime(pair, args.threads, args.rounds, args.lengths)
                else:
                    package = "onnxruntime-node" if runtime == "node" else "onnxruntime-web"
                    row["runtimes"][runtime] = js_runtime(package, pair, args.threads, args.rounds, args.lengths)
            record["models"][model] = row
        record["load_average_end"] = load_average()
    print(table(record))
    if args.out is not None:
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
