"""The ``lowering`` section: portable against fused graphs (``edgelin export --ops portable|fused``), per runtime.

Models (speed does not depend on the weights; each exported both ways, with the exporter's check against PyTorch):
the bundled model where this install has it (relu map with the denominator, a per-head decay, a short conv), and
two LinearLMs of the plan's widths (the full run: the bundled model's size; seed 0): GLA's per-feature decay
("gla") and Gated DeltaNet ("gdn": the delta rule with a per-head gate, no denominator).

Runtimes, each in one process with the two lowerings interleaved (order swapped every round; medians over the
plan's ``lowering_rounds``):

    python   edgelin's Python runtime (ONNX Runtime CPU): decode ms per token at batch 1 and 8 (``lowering_steps``
             steps, the state fed back), prefill tokens/s of one prompt per length (``Session.prefill``: one call)
    node     runtime/web/edgelin.mjs on onnxruntime-node (native CPU), batch 1; prefill in the JavaScript runtime's
             pieces of the manifest's prefill_piece (``scripts/lowering_bench.mjs``)
    wasm     the same on onnxruntime-web's WASM backend under node: the kernels a browser's wasm provider runs (not
             timed inside a browser)

node and wasm need a source checkout with node_modules (``npm ci``); without them those rows say why. Also: the
decode graph's nodes per layer as ONNX Runtime runs it (after its load-time fusions), both lowerings.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import harness
from .harness import JS_PACKAGES, alternating, load_average, medians, node_json
from .measure import node_counts
from .plan import DATA_SEED, MODEL_SEED, Plan, Progress

NODE_SCRIPT = harness.ROOT / "scripts" / "lowering_bench.mjs"
LOWERINGS = ("portable", "fused")
VARIANTS = {  # name -> LinearLM options (the widths from the plan)
    "gla": {"feature_map": "elu+1", "decay": "gla"},
    "gdn": {"feature_map": "identity", "normalisation": "none", "update": "delta", "decay": "scalar"},
}
BASE = {"vocab_size": 256, "conv_size": 4, "chunk_size": 64}
WIDTHS = ("d_model", "n_layers", "n_heads", "head_dim")


def _sources(plan: Plan) -> dict[str, Any]:
    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM
    from edgelin.models import bundled_checkpoint

    sources: dict[str, Any] = {}
    bundled = bundled_checkpoint()
    if bundled is not None and plan.decay_widths == (256, 4, 4, 64):  # the full run: the bundled model itself
        sources["bundled"] = bundled
    for name, options in VARIANTS.items():
        torch.manual_seed(MODEL_SEED)
        sources[name] = LinearLM(ModelConfig(**BASE, **dict(zip(WIDTHS, plan.decay_widths)), **options)).eval()
    return sources


def python_runtime(folders: dict[str, Path], threads: int, rounds: int, steps: int, lengths: tuple[int, ...]) -> dict[str, float]:
    """Medians of "LOWERING/METRIC" over the rounds: decode_b1_ms, decode_b8_ms, prefill_T_tok_s."""
    from edgelin.runtime import load

    sessions = {ops: load(folder, provider="cpu", threads=threads) for ops, folder in folders.items()}
    vocab = next(iter(sessions.values())).manifest.vocab_size
    rng = np.random.default_rng(DATA_SEED)

    def measure(session) -> dict[str, float]:
        out = {}
        for batch in (1, 8):
            state = session.new_state(batch)
            session.decode(np.zeros((batch, 1), np.int64), state)  # warm
            start = time.perf_counter()
            for i in range(steps):
                session.decode(np.full((batch, 1), i % vocab, np.int64), state)
            out[f"decode_b{batch}_ms"] = (time.perf_counter() - start) / steps * 1e3
        for T in lengths:
            state = session.new_state(1)
            ids = rng.integers(0, vocab, (1, T))
            start = time.perf_counter()
            session.prefill(ids, state, chunk=T, last_only=True)  # one call of T tokens
            out[f"prefill_{T}_tok_s"] = T / (time.perf_counter() - start)
        return out

    return medians(alternating({ops: (lambda r, s=sessions[ops]: measure(s)) for ops in LOWERINGS}, rounds))


def js_runtime(package: str, folders: dict[str, Path], threads: int, rounds: int, lengths: tuple[int, ...]) -> dict[str, Any]:
    """The node script's medians, or {"status": "skipped"|"failed", "reason": ...}."""
    out = node_json(NODE_SCRIPT, package, [folders["portable"], folders["fused"], threads, rounds, *lengths])
    return out if "status" in out else out["medians"]


def speedups(medians: dict[str, float]) -> dict[str, float]:
    """fused / portable speed per metric (above 1: fused is faster): ms inverted, tokens/s as they are."""
    metrics = sorted({key.split("/", 1)[1] for key in medians})
    return {m: (medians[f"portable/{m}"] / medians[f"fused/{m}"] if m.endswith("_ms") else medians[f"fused/{m}"] / medians[f"portable/{m}"])
            for m in metrics if f"portable/{m}" in medians and f"fused/{m}" in medians}


def lowering_section(plan: Plan, threads: int, say: Progress) -> dict[str, Any]:
    from edgelin.exporters import export

    sources = _sources(plan)
    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-lowering-") as tmp:
        work = Path(tmp)
        for name, source in sources.items():
            folders = {}
            for ops in LOWERINGS:
                say(f"lowering: exporting {name} ({ops}) ...")
                folders[ops] = export(source, work / f"{name}-{ops}", ops=ops).out_dir
            layers = json.loads((folders["portable"] / "edgelin.json").read_text())["model"]["n_layers"]
            row: dict[str, Any] = {"nodes_per_layer": {ops: node_counts(f / "decode.onnx", work)["as_run"] / layers for ops, f in folders.items()},
                                   "runtimes": {}}
            say(f"lowering: timing {name} in the Python runtime ...")
            row["runtimes"]["python"] = python_runtime(folders, threads, plan.lowering_rounds, plan.lowering_steps, plan.decay_lengths)
            for runtime, package in JS_PACKAGES.items():
                say(f"lowering: timing {name} in {runtime} ({package}) ...")
                row["runtimes"][runtime] = js_runtime(package, folders, threads, plan.lowering_rounds, plan.decay_lengths)
            row["fused_speedup"] = {rt: speedups(m) for rt, m in row["runtimes"].items() if "status" not in m}
            models[name] = row
    return {
        "status": "ok",
        "what": "portable vs fused graphs of each model, per runtime, interleaved: medians of LOWERING/METRIC (decode ms "
                "per token, prefill tokens/s); fused_speedup = fused / portable speed (above 1: fused is faster)",
        "lengths": list(plan.decay_lengths), "rounds": plan.lowering_rounds, "decode_steps": plan.lowering_steps,
        "load_average_end": load_average(), "models": models,
    }


__all__ = ["JS_PACKAGES", "LOWERINGS", "lowering_section", "node_json", "python_runtime", "js_runtime", "speedups"]
