"""The export's checks: PyTorch's outputs on fixed inputs (golden.json, the smoke check's prompt and decode steps),
ONNX Runtime (CPU) against them, and the floors a miss is measured against: the model's own fp32 rounding (the
same inputs in float64) and, at fp16, the checkpoint's framework at that precision."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgelin import layerwise, parity, protocol, streaming, upstream
from edgelin.errors import ExportError
from edgelin.exporters.graphs import INPUT_IDS
from edgelin.exporters.source import resolve_source
from edgelin.exporters.tracing import failure_cause
from edgelin.exporters.write import GRAPH_FILES
from edgelin.runtime import golden
from edgelin.layers.moe import moe_layers
from edgelin.runtime.manifest import Manifest, file_sha256
from edgelin.state import fresh_state, from_numpy, to_numpy
from edgelin.validate.routing import differs, routing_capture, topk_session

SMOKE_STEPS = 4  # greedy decode steps of the smoke check


def golden_run(model, manifest: Manifest, plan: golden.Plan, dtype: torch.dtype = torch.float32) -> tuple[np.ndarray, np.ndarray]:
    """The model's logits on the golden inputs: the whole prompt from a fresh state [BATCH, L, V] and the decode
    steps fed one by one after it [BATCH, steps, V], in ``dtype`` (the model's)."""
    with torch.no_grad():
        logits, state = model(torch.from_numpy(plan.prompt), fresh_state(manifest.states, golden.BATCH, dtype=dtype))
        steps = []
        for t in range(plan.decode.shape[1]):
            step, state = model.step(torch.from_numpy(plan.decode[:, t:t + 1]), state)
            steps.append(step[:, 0])
    return logits.numpy(), torch.stack(steps, 1).numpy()


def write_golden(plan: golden.Plan, logits: tuple[np.ndarray, np.ndarray], floor: parity.Errors, manifest: Manifest, budget: dict,
                  tmp: Path) -> dict:
    """``golden.json`` (``edgelin.runtime.golden``): the fp32 PyTorch model's logits on the export's fixed inputs
    (``golden_run``), and the budgets of the export's precision raised to the model's rounding floor on them
    (``floor``: fp32 vs float64; bounds set with --budget kept); returns the manifest's entry for it."""
    budgets = golden.held_budgets(manifest.precision, budget, floor)
    try:
        content = golden.make_golden(plan, *logits, manifest.precision, budgets, floor=floor)
    except ValueError as exc:
        raise ExportError(f"golden outputs: {exc}; the model computes non-finite logits on random ids (check its weights)") from None
    path = tmp / golden.GOLDEN_FILE
    path.write_text(golden.golden_text(content), encoding="utf-8")
    return {"file": golden.GOLDEN_FILE, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def smoke_reference(model, manifest: Manifest, like: dict[str, Any] | None = None) -> dict[str, Any]:
    """PyTorch's side of the smoke check: a short prompt (batch 2, T = chunk + 3, less where a declared context is
    shorter; a ragged graph: the second row 5 tokens shorter) and SMOKE_STEPS greedy decode steps. Computed right
    after the golden outputs, so that the model is no longer held when the graphs are converted, stored and loaded (an export's peak memory is then not the
    model beside ONNX Runtime's sessions). ``like``: an earlier reference whose ids and decoded tokens are fed
    again (the float64 model's run for the rounding floor: a near-tie must not pick another token)."""
    specs = manifest.states
    dtype = next(model.parameters(), torch.empty(0)).dtype
    if like is None:
        gen = torch.Generator().manual_seed(0)
        T = protocol.chunk_size(model) + 3
        if manifest.max_positions is not None:  # the prompt and its SMOKE_STEPS decode steps inside a declared context
            T = max(1, manifest.min_sequence, min(T, manifest.max_positions - SMOKE_STEPS))
        ids = torch.randint(0, manifest.vocab_size, (2, T), generator=gen)
    else:
        ids = like["ids"]
    T = ids.shape[1]
    lengths = torch.tensor([T, max(T - 5, 1)]) if manifest.lengths else None
    # a mixture-of-experts model: each run's chosen experts too (routing_capture), so that the check sets aside the
    # tokens whose experts the graphs choose otherwise (a near tie: another expert's output, not rounding)
    routed = bool(moe_layers(model))
    with torch.no_grad():
        with routing_capture(model) as chosen:
            ref, state = model(ids, fresh_state(specs, 2, dtype=dtype), **({} if lengths is None else {"lengths": lengths}))
        out = {"ids": ids, "lengths": lengths, "prefill": ref.numpy(), "steps": [], "routing": [list(chosen)] if routed else None}
        for i in range(SMOKE_STEPS):
            nxt = ref[:, -1:].argmax(-1) if like is None else like["steps"][i][0]  # [2, 1]
            with routing_capture(model) as chosen:
                ref, state = model.step(nxt, state)
            out["steps"].append((nxt, ref.numpy()))
            if routed:
                out["routing"].append(list(chosen))
    return out


def smoke_floor(reference: dict[str, Any], reference64: dict[str, Any]) -> dict[str, parity.Errors]:
    """The rounding floor of each smoke comparison: PyTorch fp32 vs float64 on its inputs (decode: the worst step)."""
    worst = parity.NONE
    for (_, a), (_, b) in zip(reference["steps"], reference64["steps"]):
        worst = worst.worst(parity.errors(a, b))
    return {"prefill": parity.errors(reference["prefill"], reference64["prefill"]), "decode": worst}


def smoke_check(reference: dict[str, Any], out: Path, manifest: Manifest) -> dict[str, parity.Errors]:
    """ORT CPU vs ``smoke_reference``'s PyTorch outputs: logits errors of the prefill and the worst decode step.
    The sessions keep the weights in the file's mapped pages (no prepacking: the check is not timed), shared by
    both. A mixture-of-experts model's tokens whose chosen experts the graphs choose otherwise are set aside, as
    validate does (``edgelin.validate.routing``): their count goes to ``reference["set_aside"]``."""
    from edgelin.runtime.providers import open_session

    sessions = {g: open_session(out / f, "cpu", prepack=False) for g, f in GRAPH_FILES.items()}
    specs = manifest.states
    lengths = reference["lengths"]
    routing = reference.get("routing")  # PyTorch's chosen experts per run (a mixture-of-experts model), else None
    tops = {g: topk_session(out / f, out) for g, f in GRAPH_FILES.items()} if routing else {}
    reference["set_aside"] = 0  # tokens whose experts the graphs choose otherwise, left out of the comparison

    def run(graph: str, x: torch.Tensor, st, want) -> tuple[np.ndarray, dict, np.ndarray | None]:
        feeds = {name: a.astype(spec.np_dtype, copy=False) for (name, a), spec in zip(to_numpy(specs, st).items(), specs)}
        if graph == "prefill" and lengths is not None:
            feeds[manifest.lengths] = lengths.numpy()
        if graph == "prefill":  # every position's logits, as the reference has
            feeds |= manifest.prefill_positions(*x.shape)
        feeds[INPUT_IDS] = x.numpy()
        got = sessions[graph].run([manifest.logits] + [s.output for s in specs], feeds)
        aside = None
        if want is not None and tops[graph][0] is not None:  # [B, t] where the graph's experts differ
            aside = differs(tops[graph][0].run(tops[graph][1], feeds), want, tuple(x.shape))
        return got[0], from_numpy(specs, {s.input: v for s, v in zip(specs, got[1:])}), aside

    def held(got: np.ndarray, ref: np.ndarray, aside: np.ndarray | None) -> parity.Errors:
        if aside is None or not aside.any():
            return parity.errors(got, ref)
        reference["set_aside"] += int(aside.sum())
        return parity.errors(got[~aside], ref[~aside]) if (~aside).any() else parity.NONE

    got, ort_state, aside = run("prefill", reference["ids"], fresh_state(specs, 2), routing[0] if routing else None)
    errors = {"prefill": held(got, reference["prefill"], aside)}
    worst = parity.NONE
    for i, (nxt, ref) in enumerate(reference["steps"]):
        got, ort_state, aside = run("decode", nxt, ort_state, routing[1 + i] if routing else None)
        worst = worst.worst(held(got, ref, aside))
    errors["decode"] = worst
    return errors


def golden_worst(tmp: Path, manifest: Manifest) -> parity.Errors:
    """ONNX Runtime (CPU) on golden.json's inputs against its rows: the worst logits errors (lower bounds where the
    file stores part of a row: ``golden.row_errors``)."""
    from edgelin.runtime.session import Session

    gold = golden.Golden.load(tmp, manifest)
    rows = golden.run_plan(Session(tmp, provider="cpu", prepack=False, check_hashes=False), gold.plan)
    worst = parity.NONE
    for got, row in zip(rows, gold.rows):
        worst = worst.worst(golden.row_errors(got, row))
    return worst


def precision_floor(checkpoint, precision: str, reference: dict[str, Any], say) -> "upstream.PrecisionFloor | None":
    """The checkpoint's own framework at ``precision`` against its float64 run, on the smoke check's prompt (both rows
    whole) and its decode steps; None, said, where there is no such framework or it cannot run here."""
    framework = upstream.framework_of(checkpoint)
    why = "edgelin's own checkpoint" if framework is None else upstream.unavailable(framework)
    if why is None and framework not in upstream.PRECISION_FRAMEWORKS:
        why = f"{framework} runs its models in float32 only here"
    if why is None:
        say(f"out of edgelin's {precision} budget: {upstream.possessive(framework)} own model at {precision} and in float64 on the same ids, in a subprocess ...")
        try:
            steps = np.concatenate([np.asarray(nxt) for nxt, _ in reference["steps"]], axis=1)  # [B, 4]: the smoke's decoded tokens
            return upstream.precision_floor(checkpoint.path, framework, precision, np.asarray(reference["ids"]), steps)
        except upstream.UpstreamError as exc:
            why = str(exc)
    say(f"{precision} precision floor not measured ({why}); edgelin's budget applies as it is")
    return None


def rounding_floor(checkpoint, caller, chunk_size, manifest: Manifest, plan, gold, reference, say,
                   scratch: Path | None = None) -> tuple[parity.Errors | None, dict[str, parity.Errors]]:
    """(floor of the golden outputs, floor of each smoke comparison): the fp32 references against the same model in
    float64, its weights converted one layer at a time (``edgelin.layerwise``: a checkpoint loaded again, mapped from a
    scratch file in ``scratch`` where given; a caller's module run as it is, never changed). (None, {}) for a module
    that does not run in float64."""
    try:
        with streaming.mapped_weights(scratch) if scratch is not None and caller is None else contextlib.nullcontext():
            model = resolve_source(checkpoint, chunk_size)[0] if caller is None else caller
        with layerwise.converted(model, keep=layerwise.fits_converted(model)):
            gold64 = golden_run(model, manifest, plan, torch.float64)
            floors = smoke_floor(reference, smoke_reference(model, manifest, like=reference))
    except (RuntimeError, TypeError, ValueError) as exc:  # a module of the caller's that computes in float32 only
        say(f"rounding floor not measured (the model does not run in float64: {failure_cause(exc)}); edgelin's budgets apply as they are")
        return None, {}
    floor = parity.errors(np.concatenate([g.reshape(-1) for g in gold]), np.concatenate([g.reshape(-1) for g in gold64]))
    return floor, floors
