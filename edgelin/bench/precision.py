"""The ``precision`` section: the model under test exported in every precision, measured in one run.

The source (default: the bundled model; ``--quick``: a tiny random ``LinearLM``) is exported here once per
precision of ``edgelin.exporters.precision`` (fp32, fp16, int8, int4), each with the exporter's own check
against PyTorch. Then, on the bench's provider:

    size     bytes on disk of both graphs, and the decode graph's weight bytes
    decode   ms per token at batch 1 and 8 (runtime Session, IO binding), the precisions interleaved in
             rotating rounds in this process
    prefill  tokens/s and peak memory per length of the plan, in fresh torch-free subprocesses, the
             precisions back to back at one length
    floor    the weight-bytes floor per token: decode-graph weight bytes / memory bandwidth (the best
             single-thread numpy copy, bytes read + written), and measured / floor

Ratios are against fp32. At the bundled model's size decode is bound by per-node overhead, not by weight
bytes; the floor column says how far each precision is from being bound by its bytes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgelin.config import ModelConfig
from edgelin.exporters import export
from edgelin.exporters.precision import CONVERTERS
from edgelin.model import LinearLM
from edgelin.runtime.session import Session

from .harness import interleaved, ratio, stats
from .measure import copy_bandwidth, graph_weight_bytes, prefill_case
from .plan import DATA_SEED, MODEL_SEED, Plan, Progress


def _source(source: Any, quick: bool) -> Any:
    """What to export: the given checkpoint folder or model, the bundled model, or (quick) a tiny random LinearLM."""
    if source is not None:
        return source
    if not quick:
        from edgelin.models import bundled_checkpoint

        bundled = bundled_checkpoint()
        if bundled is not None:
            return bundled
    torch.manual_seed(MODEL_SEED)
    return LinearLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2, head_dim=16, feature_map="relu", conv_size=4)).eval()


def precision_section(plan: Plan, threads: int, say: Progress, *, source: Any = None, provider: str = "cpu",
                      quick: bool = False) -> dict[str, Any]:
    if isinstance(source, (str, Path)) and (Path(source) / "edgelin.json").is_file():
        return {"status": "skipped", "reason": "the source is an export; the precision section needs the model itself "
                                               "(a checkpoint folder, a model, or none for the bundled model)"}
    model = _source(source, quick)
    label = str(model) if isinstance(model, (str, Path)) else f"{type(model).__name__} (random weights)"
    names = tuple(CONVERTERS)
    say(f"precision: {', '.join(names)} of {label} ...")
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-precision-") as tmp:
        work = Path(tmp)
        exports: dict[str, dict[str, Any]] = {}
        for name in names:
            say(f"  exporting {name} (checked against PyTorch) ...")
            result = export(model, work / name, precision=name, trace_cache=work / "traces")  # one trace, four precisions
            exports[name] = {"bytes_on_disk": dict(result.files), "nodes": dict(result.nodes),
                             "decode_weight_bytes": graph_weight_bytes(result.manifest.graph_path(work / name, "decode")),
                             "smoke_check_max_abs": {k: e.max_abs for k, e in (result.smoke or {}).items()}}
        sessions = {n: Session(work / n, provider, threads, session_options={"inter_op_num_threads": 1}, io_binding=True) for n in names}
        active = {n: s.provider for n, s in sessions.items()}
        vocab = sessions[names[0]].vocab_size
        rng = np.random.default_rng(DATA_SEED)

        decode: dict[str, dict[str, Any]] = {n: {} for n in names}
        for B in plan.decode_batches:
            say(f"  decode, batch {B}, interleaved ...")
            tok = rng.integers(0, vocab, (B, 1), dtype=np.int64)  # [B, 1]
            states = {n: s.new_state(B) for n, s in sessions.items()}
            cases = {n: (lambda s=sessions[n], st=states[n]: s.decode(tok, st)) for n in names}
            samples = interleaved(cases, warmup=plan.decode_warmup, rounds=plan.decode_rounds, per_round=plan.decode_per_round)
            for n in names:
                decode[n][str(B)] = stats(samples[n])

        rows = []
        for T in plan.opt_in_lengths:  # length-major: the precisions at one length run back to back
            for n in names:
                say(f"  prefill {n} T={T:,} ...")
                m = sessions[n].manifest
                rows.append({"precision": n, "T": T, **prefill_case(m.graph_path(work / n, "prefill"), m.states, provider=provider,
                                                                    threads=threads, vocab=vocab, T=T, seed=DATA_SEED, plan=plan)})
        sessions.clear()

    say("  memory bandwidth (numpy copy) ...")
    bandwidth = copy_bandwidth(plan.bandwidth_bytes, plan.bandwidth_repeats, rng)
    GBps = bandwidth["max"] * 1e9
    base = names[0]
    out = {}
    for n in names:
        floor_ms = exports[n]["decode_weight_bytes"] / GBps * 1e3  # per call: the weights are read once per call
        entry = {**exports[n], "provider_active": active[n], "decode_ms": decode[n],
                 "floor": {str(B): {"floor_ms_per_token": floor_ms / B, "measured_over_floor": decode[n][str(B)]["median"] / floor_ms}
                           for B in plan.decode_batches}}
        if n != base:
            entry["decode_over_fp32"] = {str(B): ratio(decode[n][str(B)], decode[base][str(B)]) for B in plan.decode_batches}
            entry["size_over_fp32"] = sum(exports[n]["bytes_on_disk"].values()) / sum(exports[base]["bytes_on_disk"].values())
        out[n] = entry
    return {
        "status": "ok",
        "what": "the model exported in each precision (checked against PyTorch by the exporter): bytes on disk, decode ms per "
                "token at batch 1 and 8 (ORT, IO binding, the precisions interleaved), prefill tokens/s and peak memory per "
                "length (torch-free subprocesses, back to back per length), and the weight-bytes floor per token (decode-graph "
                "weight bytes / best single-thread copy bandwidth); ratios against fp32 (decode: ms ratio, below 1 is faster)",
        "model": label, "precisions": list(names), "batches": list(plan.decode_batches), "lengths": list(plan.opt_in_lengths),
        "bandwidth_GBps": bandwidth, "models": out, "prefill": rows,
    }


__all__ = ["precision_section"]
