"""Check 8 for a foreign checkpoint: the framework it came from (transformers, fla) running its own model on the same
ids (``edgelin.upstream``, in a subprocess), against edgelin's import and against the graphs; and whether that
comparison runs at all (``upstream_plan``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from edgelin import parity, upstream as up
from edgelin.errors import EdgelinError
from edgelin.parity import BUDGETS
from edgelin.runtime.session import Session
from edgelin.layers.moe import moe_layers
from edgelin.validate.report import FAIL, NA, PASS, Check
from edgelin.validate.routing import decode_differs, differs, graph_routing, routing_capture
from edgelin.validate.validator import Validator, errors_or_inf, said_errors


# ---- 8. the framework the checkpoint came from -------------------------------------------------
def against_upstream(v: Validator, session: Session, checkpoint: Path, framework: str, steps: int, threads: int, required: bool,
                     dtype: str = "float64", note: str = "") -> dict[str, Any]:
    """edgelin's import and the graphs against ``framework``'s own model on the same ids: a prompt of C + 5
    tokens (batch 2: across a chunk boundary), ``steps`` tokens through its cache, GREEDY greedy tokens. The import
    is held to the fp32 upstream budget (both are fp32 PyTorch), the graphs to the export precision's. ``dtype``: the
    framework's model's (float32 where float64 does not fit in memory: ``note`` says so, in the report's "how")."""

    C = v.chunk
    prompt, ids = v.ids(2, C + 5), v.ids(2, steps)
    # planned again now: validate's own session and model hold memory that was free when it started
    now, said = up.fitting_dtype(checkpoint, framework)
    if now is None:
        v.add(Check("upstream", f"import vs {framework}", FAIL if required else NA,
                    where=f"not run: {said}, beside validate's own session and model; the graphs were held to edgelin's import only"))
        return {}
    if now != dtype:
        dtype, note = now, said
    slow = " (its kernels in Triton's interpreter: minutes; --steps bounds it)" if framework == "fla" else ""
    v.say(f"upstream: running {up.possessive(framework)} own model on the checkpoint, {steps} decode steps, in a subprocess{slow} ...")
    try:
        ref = up.run(checkpoint, framework, prompt, ids, threads=threads, **({"dtype": dtype} if framework == "transformers" else {}))
    except up.UpstreamError as exc:
        v.add(Check("upstream", f"import vs {framework}", FAIL if required else NA, where=str(exc)))
        return {}
    fp32 = parity.with_overrides(BUDGETS["fp32"], {k: v for k, v in v.overrides.items() if k == "upstream"})["upstream"]
    fp32 = parity.floored(fp32, v.floor["logits"], keep=v.overrides.get("upstream", {}))
    graph_budget = v.held("upstream")
    k = ref.greedy.shape[1]
    layers = len(moe_layers(v.model))  # a mixture-of-experts model: the import's chosen experts, per call (routing_capture)
    with routing_capture(v.model) as chosen:
        mine_prefill, mine_decode, mine_greedy, mine_hidden = up.import_outputs(v.model, prompt, ids, k)
    mine_routing = [chosen[i * layers:(i + 1) * layers] for i in range(1 + steps)] if layers else None
    departs = ""

    def departure() -> str:
        nonlocal departs
        departs = departs or up.first_departure(v.model, mine_hidden, ref.hidden, fp32["rel_l2"])
        return departs

    T, B = prompt.shape[1], prompt.shape[0]
    need = v.budgets["greedy"]["min_agreement"]
    # the import vs the framework
    e = errors_or_inf(mine_prefill, ref.prefill)
    ok = import_ok = parity.within(e, fp32)
    v.add(Check.of("upstream", f"import vs {framework}: prefill T={T} batch={B}", ok, e, fp32, "" if ok else departure()))
    e, where = _steps(v, mine_decode, ref.decode, fp32)
    if where and not import_ok:
        where += f"; over the prompt it {departure()}"
    v.add(Check.of("upstream", f"import vs {framework}: {steps} cached decode steps", not where, e, fp32, where))
    # the graphs vs the framework
    # tokens whose experts the graphs choose otherwise than the import (which is held to the framework above) are set
    # aside, as in the prefill and decode checks (edgelin.validate.routing), and counted
    state = session.new_state(B)
    got_prefill = session.prefill(prompt, state)
    aside = differs(graph_routing(v, session, prompt), mine_routing[0], prompt.shape) if mine_routing else None
    got_decode, aside_steps = [], []
    for t in range(steps):
        before = state.numpy() if mine_routing else None
        got_decode.append(session.decode(ids[:, t : t + 1], state)[:, -1])
        aside_steps.append(decode_differs(v, ids[:, t : t + 1], before, mine_routing[1 + t]) if mine_routing else None)
    got_decode = np.stack(got_decode)
    name = f"graphs vs {framework}: prefill T={T} batch={B}"
    held, want = got_prefill, ref.prefill
    if aside is not None and aside.any():
        name += f", {int(aside.sum())} of {aside.size} positions set aside (their experts differ: see routing)"
        held, want = held[~aside], want[~aside]
    e = errors_or_inf(held, want)
    ok = parity.within(e, graph_budget)
    note = "" if ok else (f"logits {said_errors(e)}" + ("" if import_ok else f"; the import {departure()}"))
    v.add(Check.of("upstream", name, ok, e, graph_budget, note))
    e, where = _steps(v, got_decode, ref.decode, graph_budget, aside_steps)
    n = sum(int(a.sum()) for a in aside_steps if a is not None)
    name = f"graphs vs {framework}: {steps} decode steps, state fed back" + (f", {n} tokens set aside (their experts differ: see routing)" if n else "")
    v.add(Check.of("upstream", name, not where, e, graph_budget, where))
    # greedy ids after the prompt and the steps, each side through its own state
    got = up.greedy_ids(got_decode[-1], lambda tok: session.decode(tok, state)[:, -1], k)
    for who, ids_k in (("import", mine_greedy), ("graphs", got)):
        agree, where = up.greedy_agreement(ids_k, ref.greedy)
        bound = need if who == "graphs" else 1.0  # the import is fp32 PyTorch: token for token
        ok = agree >= bound
        v.add(Check("upstream", f"{who} vs {framework}: greedy {k} tokens x {B} rows, {agree * 100:.0f}% before the first difference",
                       PASS if ok else FAIL, budget={"min_agreement": bound}, where="" if ok else where))
    return {"framework": framework, "how": ref.how + (f" ({note})" if note else ""), "model_class": ref.model_class, "seconds": ref.seconds,
            "prompt_tokens": T, "batch": B, "decode_steps": steps, "greedy_tokens": k}


def _steps(v: Validator, got: np.ndarray, ref: np.ndarray, budget: dict, aside: list | None = None) -> tuple[parity.Errors, str]:
    """Worst errors over decode steps [N, B, V], and the first step out of budget; ``aside``: per step, the rows [B, 1]
    to leave out (None: none)."""
    worst, where = parity.NONE, ""
    for t in range(ref.shape[0]):
        rows = None if aside is None or aside[t] is None else ~aside[t].reshape(-1)
        if rows is not None and not rows.any():
            continue
        e = errors_or_inf(got[t] if rows is None else got[t][rows], ref[t] if rows is None else ref[t][rows])
        worst = worst.worst(e)
        if not where and not parity.within(e, budget):
            where = f"first diverging step {t}: logits {said_errors(e)}"
    return worst, where


def upstream_plan(mode: str, checkpoint: Path | None, available: int | None = None) -> tuple[str | None, str, str]:
    """(the framework to run, or None; why none runs, for the report: '' where nothing needs saying -- edgelin's own
    model, or an in-memory one, is the model validated; the dtype its model runs in: float64, or float32 where only
    that fits in memory, ``edgelin.upstream.fitting_dtype``). "required" that cannot be met is an EdgelinError here,
    before any check runs. ``available``: the memory to plan for (default: available now)."""
    from edgelin import upstream

    upstream.check_mode(mode)
    if mode == "off":
        return None, "", ""
    framework = None if checkpoint is None else upstream.framework_of(checkpoint)
    if framework is None:
        why = ("the model was passed in memory" if checkpoint is None else "the checkpoint is edgelin's own model") + \
            ": there is no other framework's model to compare with"
        if mode == "required":
            raise EdgelinError(f"--upstream required: {why}; use --upstream auto or off")
        return None, "", ""  # nothing was left uncompared: the model validated is the model
    missing = upstream.unavailable(framework)
    if missing:
        if mode == "required":
            raise EdgelinError(f"--upstream required: {missing}")
        return None, f"not compared: {missing}", ""
    dtype, note = upstream.fitting_dtype(checkpoint, framework, available)
    if dtype is None:
        if mode == "required":
            raise EdgelinError(f"--upstream required: {note}; validate on a machine with more memory, or use --upstream auto "
                               "(the graphs are then held to edgelin's import only)")
        return None, (f"not compared: {note}; the graphs were held to edgelin's import of the checkpoint only (run "
                      "--upstream on a machine with more memory)"), ""
    return framework, note, dtype
