"""The inputs and outputs of both graphs, as the manifest's fields imply them (input_ids, lengths, logits_at,
logits, vocab_size, states), and the prefill graph's ``logits_at`` feed. Standard library + numpy only."""

from __future__ import annotations

from typing import Any

import numpy as np

from edgelin.runtime.manifest.format import BATCH, PAST, POSITIONS, PRESENT, SEQUENCE_DIM


def tensor(name: str, dtype: str, shape: list) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def implied_io(graph: str, input_ids: str, logits: str, logits_dtype: str, vocab: int, states: list[dict], lengths: str | None,
               logits_at: str | None = None) -> dict[str, list]:
    """The io of ``graph`` implied by the manifest fields (states as dicts): input_ids, the prefill graph's
    lengths and logits_at if any, every state input; logits (of the asked positions, where logits_at is), every
    state output."""
    seq = SEQUENCE_DIM[graph]
    prefill = graph == "prefill"
    ragged = [tensor(lengths, "int64", [BATCH])] if lengths is not None and prefill else []
    picked = [tensor(logits_at, "int64", [BATCH, POSITIONS])] if logits_at is not None and prefill else []
    return {
        "inputs": [tensor(input_ids, "int64", [BATCH, seq])] + ragged + picked + [tensor(s["input"], s["dtype"], s["shape"]) for s in states],
        "outputs": [tensor(logits, logits_dtype, [BATCH, POSITIONS if picked else seq, vocab])]
        + [tensor(s["output"], s["dtype"], [PRESENT if d == PAST else d for d in s["shape"]]) for s in states],
    }


def positions_feed(batch: int, tokens: int, last: bool = False) -> np.ndarray:
    """The prefill graph's ``logits_at`` for ``batch`` rows of ``tokens``: every position, int64 [batch, tokens],
    or (``last``) the last one only, [batch, 1]."""
    row = np.array([tokens - 1], dtype=np.int64) if last else np.arange(tokens, dtype=np.int64)
    return np.ascontiguousarray(np.broadcast_to(row, (batch, row.size)))


def sync_io(d: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the ``io`` of a manifest dict from its input_ids, lengths, logits_at, logits, vocab_size and states, in
    place (for tools and tests that edit a manifest by hand); the logits dtype is kept. Returns ``d``."""
    logits_dtype = d.get("io", {}).get("prefill", {}).get("outputs", [{}])[0].get("dtype", "float32")
    for g in SEQUENCE_DIM:
        d.setdefault("io", {})[g] = implied_io(g, d["input_ids"], d["logits"], logits_dtype, d["vocab_size"], d["states"], d.get("lengths"),
                                       d.get("logits_at"))
    return d
