"""The ``hybrid`` section: decode cost and state size against context length, pure-linear vs hybrid vs softmax.

Three ``LinearLM`` of one size (the bundled model's shape: relu, short conv 4, decay ``scalar``, bytes; the plan's
widths, as the decay section's, with at least 2 layers: the full run is the bundled model's size, d_model 256, 4
layers of 4 heads x 64), random weights (speed does not depend on them), each exported with the exporter's check
against PyTorch:

    linear   every layer linear attention (the bundled model's stack)
    hybrid   the last layer softmax attention with a KV cache, the others linear (for 4 layers Qwen3.5's 3:1)
    softmax  every layer softmax attention

Each is decoded at batch 1 through the torch-free runtime at each position of the plan (``hybrid_positions``: 1k,
16k, 64k in the full run) from a state built at that position (KV caches of that many positions holding random
values, counters at the position): a step's cost depends on the cache's size, not on its values, so prefilling 64k
tokens first would only take longer. The three models take turns in rotating rounds at each position
(``interleaved``); the state's size is the manifest's (``Manifest.state_bytes``). No quality is measured here (the
kernel-choice table of the bundled model's card has bits per byte of trained linear, hybrid and softmax stacks).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.config import ModelConfig
from edgelin.runtime.session import Session
from edgelin.runtime.state import State

from . import baselines
from .harness import interleaved, ratio, stats
from .plan import DATA_SEED, Plan, Progress

# The bundled model's shape (models/stdlib-linear); the widths come from the plan.
HYBRID_BASE = {"vocab_size": 256, "feature_map": "relu", "conv_size": 4, "decay": "scalar"}
WIDTHS = ("d_model", "n_layers", "n_heads", "head_dim")
STACKS = ("linear", "hybrid", "softmax")


def attention_layers(stack: str, n_layers: int) -> list[int]:
    """The layers that are softmax attention in each stack."""
    return {"linear": [], "hybrid": [n_layers - 1], "softmax": list(range(n_layers))}[stack]


def state_at(session: Session, position: int, rng: np.random.Generator) -> State:
    """A batch-1 state holding ``position`` positions: KV caches of random values, position counters at ``position``,
    the fixed-size linear states random too."""
    arrays = {}
    for spec in session.manifest.states:
        shape = spec.concrete_shape(1, position if spec.window is None else min(position, spec.window))
        if spec.dtype == "int64":
            arrays[spec.input] = np.full(shape, position, dtype=np.int64)
        else:
            arrays[spec.input] = (0.1 * rng.standard_normal(shape)).astype(spec.np_dtype)
    return State.from_arrays(session.manifest, arrays, copy=False)


def hybrid_section(plan: Plan, threads: int, say: Progress) -> dict[str, Any]:
    base = {**HYBRID_BASE, **dict(zip(WIDTHS, plan.decay_widths))}
    base["n_layers"] = max(2, base["n_layers"])  # at least one linear layer beside the hybrid's attention layer
    configs = {s: ModelConfig(**base, attn_layers=attention_layers(s, base["n_layers"])) for s in STACKS}
    say(f"hybrid: {', '.join(STACKS)} stacks of LinearLM {base} (random weights) ...")
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-hybrid-") as tmp:
        work = Path(tmp)
        done, parameters = baselines.export_linear_models(configs, work, say)
        sessions = {s: Session(work / s, "cpu", threads, session_options={"inter_op_num_threads": 1}) for s in STACKS}
        rng = np.random.default_rng(DATA_SEED)
        tok = rng.integers(0, HYBRID_BASE["vocab_size"], (1, 1), dtype=np.int64)
        rows = []
        for position in plan.hybrid_positions:  # position-major: the three stacks take turns at one position
            say(f"  decode at position {position:,}, batch 1, interleaved ...")
            states = {s: state_at(sessions[s], position, rng) for s in STACKS}
            cases = {s: (lambda sess=sessions[s], st=states[s]: sess.decode(tok, st)) for s in STACKS}
            samples = interleaved(cases, warmup=plan.decode_warmup, rounds=plan.decode_rounds, per_round=plan.decode_per_round)
            for s in STACKS:
                rows.append({"stack": s, "position": position, "decode_ms": stats(samples[s]),
                             "state_bytes": sessions[s].manifest.state_bytes(1, position)})
            states.clear()
        sessions.clear()
    by = {(r["stack"], r["position"]): r for r in rows}
    for r in rows:
        linear = by[("linear", r["position"])]
        r["decode_over_linear"] = ratio(r["decode_ms"], linear["decode_ms"])
    return {
        "status": "ok",
        "what": "LinearLM stacks of one size (random weights, exported and checked here): every layer linear, the last "
                "layer softmax attention with a KV cache (hybrid), every layer softmax; decode ms per token at batch 1 "
                "(ORT, interleaved) from a state built at each position, and the state's bytes there; decode_over_linear: "
                "ms ratio against the linear stack at that position (above 1 is slower)",
        "config": base, "stacks": {s: {"attn_layers": attention_layers(s, base["n_layers"]), "parameters": parameters[s],
                                       "nodes": done[s]["nodes"], "export_seconds": done[s]["seconds"]} for s in STACKS},
        "positions": list(plan.hybrid_positions), "rows": rows,
    }


__all__ = ["HYBRID_BASE", "STACKS", "attention_layers", "hybrid_section", "state_at"]
