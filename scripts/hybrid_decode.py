"""Decode cost and state size against context length: a pure-linear stack, a hybrid and a softmax stack of equal size.

Three LinearLMs with the bundled model's config (d_model 256, 4 layers of 4 heads x 64, byte vocabulary):
"linear" (every layer linear attention, as the bundled model), "hybrid" (layer 3 softmax attention with a KV cache:
three linear layers to one attention layer, Qwen3.5's ratio) and "softmax" (every layer attention). Each is
exported (fp32), then decoded through the torch-free runtime at positions P = 1k, 16k, 64k (by default): the
state is built at P directly (a KV cache of P positions with random values, position counters at P), since a
decode step's cost depends on the cache's size, not its values -- prefilling 64k tokens first would only take
longer. Rounds are interleaved (model after model, P after P) and the median step of all rounds is reported, with
the state's size from the manifest (``Manifest.state_bytes``). Weights are random-init: no quality is measured.

    .venv/bin/python scripts/hybrid_decode.py [--positions 1024,16384,65536] [--steps 20] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def build(kind: str):
    import torch

    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    base = json.loads((Path(__file__).resolve().parents[1] / "models" / "stdlib-linear" / "config.json").read_text())
    layers = {"linear": [], "hybrid": [3], "softmax": [0, 1, 2, 3]}[kind]
    torch.manual_seed(0)
    return LinearLM(ModelConfig.from_dict(base | {"attn_layers": layers})).eval()


def state_at(session, position: int, rng) -> "object":
    """A batch-1 state holding ``position`` positions: KV caches of random values, counters at ``position``."""
    from edgelin.runtime import State

    m = session.manifest
    arrays = {}
    for s in m.states:
        shape = s.concrete_shape(1, position if s.window is None else min(position, s.window))
        if s.dtype == "int64":
            arrays[s.input] = np.full(shape, position, dtype=np.int64)
        else:
            arrays[s.input] = (0.1 * rng.standard_normal(shape)).astype(s.np_dtype)
    return State.from_arrays(m, arrays, copy=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--positions", default="1024,16384,65536", help="context positions to decode at (comma-separated)")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per model, position and round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--json", type=Path, help="write the table as JSON here")
    args = ap.parse_args()
    positions = [int(p) for p in args.positions.split(",")]

    from edgelin.exporters import export
    from edgelin.runtime import load

    kinds = ("linear", "hybrid", "softmax")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for kind in kinds:
            t = time.perf_counter()
            out = Path(tmp) / kind
            export(build(kind), out, check=False)
            sessions[kind] = load(out, provider="cpu", threads=args.threads)
            print(f"exported {kind} in {time.perf_counter() - t:.0f} s", flush=True)
        times: dict[tuple[str, int], list[float]] = {(k, p): [] for k in kinds for p in positions}
        for r in range(args.rounds):
            for p in positions:
                for kind in kinds:
                    s = sessions[kind]
                    state = state_at(s, p, rng)
                    ids = np.array([[65]], dtype=np.int64)
                    s.decode(ids, state)  # warm-up: first run at this shape
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        s.decode(ids, state)
                        times[kind, p].append(time.perf_counter() - t)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        rows = []
        for p in positions:
            for kind in kinds:
                m = sessions[kind].manifest
                rows.append({"model": kind, "position": p, "decode_ms": 1e3 * statistics.median(times[kind, p]),
                             "state_mb": m.state_bytes(1, p) / 1e6})
    print(f"\n{'position':>9} {'model':>8} {'decode ms/token':>16} {'state MB':>9}")
    for row in rows:
        print(f"{row['position']:>9,} {row['model']:>8} {row['decode_ms']:>16.2f} {row['state_mb']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "steps": args.steps, "rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
