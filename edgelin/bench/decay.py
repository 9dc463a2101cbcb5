"""The ``decay`` section: what a decayed ``LinearLM`` costs against the plain one, same size, one run.

One ``LinearLM`` per decay of ``ModelConfig.decay`` (none, fixed, scalar, gla), and where ModelConfig has the
delta rule (``update``), one Gated DeltaNet-style model ``scalar+delta`` (decay scalar, update delta,
normalisation none), all of one shape (``DECAY_BASE``:
relu, short conv 4, bytes) and the plan's widths (the full run: the bundled model's size, d_model 256, 4 layers,
4 heads x 64; --quick: tiny), random weights (speed does not depend on them), each exported with the exporter's check against PyTorch (in up to two worker processes, as
the bench's other exports). Then:

    decode   ms per token at batch 1 through each export's decode graph (runtime Session, IO binding), the
             models interleaved in rotating rounds in this process
    prefill  tokens/s of each export's prefill graph at each length of the plan (``decay_lengths``: 1k, 4k, 16k
             in the full run, so the chunk forms' scaling shows: tokens/s at 16k over 1k), one call per prompt, in
             fresh torch-free subprocesses (peak memory too), the models back to back at one length; then the
             longest prompt again in calls of the plan's piece (the runtime's default, the manifest's prefill_piece)
    nodes    node counts of both graphs

Ratios are against decay "none". Without a ``decay`` field in ``ModelConfig`` the section is skipped, with
the reason.

Beside them (``fla``): flash-linear-attention's newer recurrences against its Gated DeltaNet, of the plan's widths (the
full run: the bundled model's size; vocabulary 512, MLP 3 x d_model): KDA (a gate per channel), Gated DeltaProduct (two
Householder steps a token, forget gate) and RWKV-7 (the generalised delta rule), the plan's ``decay_fla`` models (none
in --quick: an fla export alone costs ~15 s of CPU), each
built with fla's own config and random init in an export worker, saved, imported through edgelin's fla importer and
exported portable with the check (``max_sequence`` the longest length: one call of it is exact). Decode interleaved as
above; prefill one call at each length and, above the plan's piece, in calls of the piece, the models back to back
at each length. Ratios are against fla's Gated DeltaNet. Without fla (or triton, which its models import) these rows
are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgelin import config as config_module
from edgelin.config import ModelConfig
from edgelin.runtime.session import Session

from . import baselines
from .fla_models import FLA_BASELINE, FLA_MODELS, FLA_VOCAB, fla_config, fla_missing
from .harness import interleaved, ratio, stats
from .measure import prefill_case
from .plan import DATA_SEED, BenchError, Plan, Progress

# The bundled model's shape (models/stdlib-linear, less its decay); the widths come from the plan.
DECAY_BASE = {"vocab_size": 256, "feature_map": "relu", "conv_size": 4}
WIDTHS = ("d_model", "n_layers", "n_heads", "head_dim")
DELTA_VARIANT = "scalar+delta"  # Gated DeltaNet: the scalar decay with the delta rule (no denominator)


def decays() -> tuple[str, ...] | None:
    """The models to measure: the decays ModelConfig offers, then ``DELTA_VARIANT`` where it has the delta rule;
    None where it has no ``decay`` field."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if "decay" not in fields:
        return None
    names = tuple(getattr(config_module, "DECAYS", ()))
    if "update" in fields and "delta" in getattr(config_module, "UPDATES", ()) and "scalar" in names:
        names += (DELTA_VARIANT,)
    return names


def variant_config(base: dict[str, Any], name: str) -> ModelConfig:
    if name == DELTA_VARIANT:
        return ModelConfig(**base, decay="scalar", update="delta", normalisation="none")
    return ModelConfig(**base, decay=name)


def decay_section(plan: Plan, threads: int, say: Progress) -> dict[str, Any]:
    names = decays()
    if not names:
        return {"status": "skipped", "reason": "this version's ModelConfig has no 'decay' field: no decayed LinearLM to measure"}
    base = {**DECAY_BASE, **dict(zip(WIDTHS, plan.decay_widths))}
    configs = {d: variant_config(base, d) for d in names}
    say(f"decay: {', '.join(names)} on LinearLM {base} (random weights) ...")
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-decay-") as tmp:
        work = Path(tmp)
        done, parameters = baselines.export_linear_models(configs, work, say)
        sessions = {d: Session(work / d, "cpu", threads, session_options={"inter_op_num_threads": 1}, io_binding=True) for d in names}
        rng = np.random.default_rng(DATA_SEED)

        say("  decode, batch 1, interleaved ...")
        tok = rng.integers(0, DECAY_BASE["vocab_size"], (1, 1), dtype=np.int64)  # [1, 1]
        states = {d: s.new_state(1) for d, s in sessions.items()}
        cases = {d: (lambda s=sessions[d], st=states[d]: s.decode(tok, st)) for d in names}
        samples = interleaved(cases, warmup=plan.decode_warmup, rounds=plan.decode_rounds, per_round=plan.decode_per_round)
        decode = {d: stats(samples[d]) for d in names}

        rows = []
        longest = plan.decay_lengths[-1]
        runs = [(T, None) for T in plan.decay_lengths] + ([(longest, plan.piece)] if longest > plan.piece else [])
        for T, piece in runs:  # length-major: the decays at one length run back to back; last, the runtime's pieces
            for d in names:
                say(f"  prefill {d:12s} T={T:,}" + (f" in pieces of {piece:,}" if piece else "") + " ...")
                m = sessions[d].manifest
                rows.append({"decay": d, "T": T, "piece": piece,
                             **prefill_case(m.graph_path(work / d, "prefill"), m.states, provider="cpu", threads=threads,
                                            vocab=DECAY_BASE["vocab_size"], T=T, seed=DATA_SEED, plan=plan, piece=piece)})
        sessions.clear()
    ok = {(r["decay"], r["T"]): r for r in rows if r["status"] == "ok" and not r["piece"]}
    in_pieces = {r["decay"]: r for r in rows if r["status"] == "ok" and r["piece"]}
    plain = "none"
    models = {}
    for d in names:
        entry: dict[str, Any] = {"decode_ms": decode[d], "nodes": done[d]["nodes"], "export_seconds": done[d]["seconds"],
                                 "parameters": parameters[d]}
        if d != plain:
            entry["decode_over_none"] = ratio(decode[d], decode[plain])
            entry["prefill_tokens_per_s_over_none"] = {str(T): ok[(d, T)]["tokens_per_s"] / ok[(plain, T)]["tokens_per_s"]
                                                       for T in plan.decay_lengths if (d, T) in ok and (plain, T) in ok}
        first, last = plan.decay_lengths[0], plan.decay_lengths[-1]
        if (d, first) in ok and (d, last) in ok and last > first:  # a chunked form scales linearly: about 1
            entry["scaling"] = {"from": first, "to": last, "tokens_per_s_ratio": ok[(d, last)]["tokens_per_s"] / ok[(d, first)]["tokens_per_s"]}
            if d in in_pieces:  # the runtime's default: the longest prompt in prefill_piece calls, over the first length's one call
                entry["scaling"] |= {"piece": in_pieces[d]["piece"],
                                     "pieces_tokens_per_s_ratio": in_pieces[d]["tokens_per_s"] / ok[(d, first)]["tokens_per_s"]}
        models[d] = entry
    return {
        "fla": fla_section(plan, threads, say),
        "status": "ok",
        "what": "LinearLM of one size with each decay (random weights, exported and checked here): decode ms per token at "
                "batch 1 (ORT, IO binding, interleaved) and prefill tokens/s per length (torch-free subprocesses, back to "
                "back per length); ratios against decay 'none' (decode: ms ratio, above 1 is slower; prefill: tokens/s "
                "ratio, below 1 is slower); scaling: tokens/s at the last length over the first, one call each, and the last "
                "length in calls of 'piece' tokens (the runtime's default) over the first",
        "config": base, "decays": list(names), "lengths": list(plan.decay_lengths),
        "models": models, "prefill": rows,
    }


def fla_section(plan: Plan, threads: int, say: Progress) -> dict[str, Any]:
    """The fla recurrences' rows (the module docstring), or {"status": "skipped", "reason": ...}."""
    names = [n for n in FLA_MODELS if n in plan.decay_fla]
    if not names:  # the quick plan: an fla export costs ~15 s of CPU even at its widths
        return {"status": "skipped", "reason": f"this plan measures none of fla's models (the full run: {', '.join(FLA_MODELS)})"}
    why = fla_missing()
    if why:
        return {"status": "skipped", "reason": why}
    configs = {n: fla_config(n, plan.decay_widths) for n in names}
    longest = plan.decay_lengths[-1]
    say(f"decay: fla's {', '.join(names)} at widths {plan.decay_widths} (random init) ...")
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-decay-fla-") as tmp:
        work = Path(tmp)
        jobs = [{"name": n, "kind": "fla", "fla": n, "config": configs[n], "checkpoint": str(work / f"{n}-checkpoint"),
                 "path": str(work / n), "opset": baselines.DEFAULT_OPSET, "max_sequence": longest} for n in names]
        try:
            done = baselines.export_fla_models(jobs, work, say)
        except BenchError as exc:
            return {"status": "failed", "reason": str(exc)}
        sessions = {n: Session(work / n, "cpu", threads, session_options={"inter_op_num_threads": 1}, io_binding=True)
                    for n in names}
        rng = np.random.default_rng(DATA_SEED)
        say("  decode, batch 1, interleaved ...")
        tok = rng.integers(0, FLA_VOCAB, (1, 1), dtype=np.int64)  # [1, 1]
        states = {n: s.new_state(1) for n, s in sessions.items()}
        cases = {n: (lambda s=sessions[n], st=states[n]: s.decode(tok, st)) for n in names}
        samples = interleaved(cases, warmup=plan.decode_warmup, rounds=plan.decode_rounds, per_round=plan.decode_per_round)
        decode = {n: stats(samples[n]) for n in names}
        rows = []
        runs = [(T, None) for T in plan.decay_lengths] + [(T, plan.piece) for T in plan.decay_lengths if T > plan.piece]
        for T, piece in runs:  # length-major: the models at one length back to back
            for n in names:
                say(f"  prefill {n:18s} T={T:,}" + (f" in pieces of {piece:,}" if piece else "") + " ...")
                m = sessions[n].manifest
                rows.append({"model": n, "T": T, "piece": piece,
                             **prefill_case(m.graph_path(work / n, "prefill"), m.states, provider="cpu", threads=threads,
                                            vocab=FLA_VOCAB, T=T, seed=DATA_SEED, plan=plan, piece=piece)})
        sessions.clear()
    ok = {(r["model"], r["T"], r["piece"]): r["tokens_per_s"] for r in rows if r["status"] == "ok"}
    models = {}
    for n in names:
        entry: dict[str, Any] = {"config": configs[n], "decode_ms": decode[n], "nodes": done[n]["nodes"],
                                 "export_seconds": done[n]["seconds"], "parameters": done[n]["parameters"],
                                 "prefill_tokens_per_s": {str(T): ok.get((n, T, None)) for T in plan.decay_lengths},
                                 "prefill_pieces_tokens_per_s": {str(T): ok.get((n, T, plan.piece)) for T in plan.decay_lengths
                                                                 if T > plan.piece}}
        if n != FLA_BASELINE and FLA_BASELINE in names:
            entry["decode_over_baseline"] = ratio(decode[n], decode[FLA_BASELINE])
            entry["prefill_tokens_per_s_over_baseline"] = {
                f"{T}" + (f"/{piece}" if piece else ""): ok[(n, T, piece)] / ok[(FLA_BASELINE, T, piece)]
                for T, piece in runs if (n, T, piece) in ok and (FLA_BASELINE, T, piece) in ok}
        models[n] = entry
    return {
        "status": "ok", "baseline": FLA_BASELINE, "models": models, "prefill": rows, "lengths": list(plan.decay_lengths),
        "piece": plan.piece, "max_sequence": longest,
        "what": "fla's models (fla's configs, random init) imported by edgelin's fla importers and exported portable: decode "
                "ms per token at batch 1 (ORT, IO binding, interleaved), prefill tokens/s in one call per length and in calls "
                "of 'piece' tokens above it (torch-free subprocesses, back to back per length); ratios against fla's Gated "
                "DeltaNet (decode: ms ratio, above 1 is slower; prefill: tokens/s ratio, below 1 is slower; key T or T/piece)",
    }


__all__ = ["DECAY_BASE", "DELTA_VARIANT", "decay_section", "decays", "fla_section", "variant_config"]
