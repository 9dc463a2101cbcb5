"""Checks 2-4: the prefill graph and the decode graph against PyTorch (logits and every state), and the two graphs
against each other (prefill == decode steps, a prefill continued from a state, a ragged batch == each prompt alone)."""

from __future__ import annotations

import numpy as np
import torch

from edgelin import parity
from edgelin.runtime.session import Session
from edgelin.state import fresh_state, from_numpy
from edgelin.validate.report import Check
from edgelin.validate.routing import decode_differs, prefill_differs, step_routing
from edgelin.validate.validator import Validator, errors_or_inf, nonfinite_note, said_errors


# ---- 2. prefill vs PyTorch -----------------------------------------------------------------
def prefill_vs_torch(v: Validator, session: Session) -> None:
    C = v.chunk
    for batch, T in ((1, 1), (3, max(C - 1, 1)), (2, C + 1), (3, 3 * C + 5)):
        ids = v.ids(batch, T)
        state = session.new_state(batch)
        logits = session.prefill(ids, state)
        with torch.no_grad():
            ref, ref_state = v.model(torch.from_numpy(ids))
            held_state = ref_state if v.quantised is None else v.quantised(torch.from_numpy(ids))[1]
        floor, state_floor = v.rounding(ids, ref, ref_state)
        lb, sb = v.held("logits", floor), v.held("state", state_floor)
        name, held, want = f"T={T} batch={batch}", logits, ref.numpy()
        differs = prefill_differs(v, session, ids)  # a mixture-of-experts model: positions whose experts differ
        if differs is not None and differs.any():  # set aside: another expert's output, not rounding (the routing check counts them)
            name += f", {int(differs.sum())} of {differs.size} positions set aside (their experts differ: see routing)"
            held, want = logits[~differs], want[~differs]
        e = errors_or_inf(held, want) if held.size else parity.NONE
        state_rel, bad_state = v.compare_states(state.numpy(), held_state, sb)
        ok = parity.within(e, lb) and not bad_state and held.size > 0
        where = ""
        if not ok:
            where = ("every position's experts differ from PyTorch's" if not held.size else "") or nonfinite_note(logits, "ORT logits") \
                or bad_state or f"logits out of budget: {said_errors(e)}"
            if bad_state and parity.within(e, lb):
                where += " (logits within budget)"
        v.add(Check.of("prefill", name, ok, e, {**lb, "state_rel_l2": sb["rel_l2"]}, where))


# ---- 3. decode vs PyTorch, state fed back --------------------------------------------------
def decode_vs_torch(v: Validator, session: Session, steps: int) -> None:
    batch = 2
    ids = v.ids(batch, steps)
    state = session.new_state(batch)
    ref_state = fresh_state(v.specs, batch)
    held_state = None if v.quantised is None else fresh_state(v.specs, batch)  # the quantised model's chain
    state64 = fresh_state(v.specs, batch, dtype=torch.float64)
    worst, where = parity.NONE, ""
    floor, state_floor = parity.NONE, parity.NONE  # the worst over the steps so far: rounding accumulates in the state
    aside = 0  # (step, row)s whose experts differ (a mixture-of-experts model): set aside, counted by the routing check
    for t in range(steps):
        before = state.numpy() if v.moe else None  # the inputs of this step, for the decode graph's routing
        logits = session.decode(ids[:, t : t + 1], state)
        with torch.no_grad():
            x = torch.from_numpy(ids[:, t : t + 1])
            ref, ref_state, chosen = step_routing(v, ids[:, t : t + 1], ref_state)
            if held_state is not None:
                held_state = v.quantised.step(x, held_state)[1]
            if not v.no_floor:
                try:
                    ref64, state64 = v.model64().step(x, state64)
                except (RuntimeError, TypeError, ValueError) as exc:
                    v.no_floor = f"the model does not run in float64 ({str(exc).splitlines()[0][:200]})"
        if not v.no_floor:
            f, fs = v.floors(ref, ref64, ref_state, state64)
            floor, state_floor = floor.worst(f), state_floor.worst(fs)
        lb, sb = v.held("logits", floor), v.held("state", state_floor)
        got, want = logits, ref.numpy()
        differs = None if before is None else decode_differs(v, ids[:, t : t + 1], before, chosen)
        if differs is not None and differs.any():
            aside += int(differs.sum())
            got, want = got[~differs], want[~differs]
        e = errors_or_inf(got, want) if got.size else parity.NONE
        worst = worst.worst(e)
        if not where:
            _, bad_state = v.compare_states(state.numpy(), ref_state if held_state is None else held_state, sb)
            if bad_state or not parity.within(e, lb):
                where = f"first diverging step {t}: " + (bad_state or f"logits {said_errors(e)}")
    name = f"{steps} steps, state fed back" + (f", {aside} of {steps * batch} tokens set aside (their experts differ: see routing)" if aside else "")
    v.add(Check.of("decode", name, not where, worst, lb, where))


# ---- 4. the two graphs agree ---------------------------------------------------------------
def graphs_agree(v: Validator, session: Session) -> None:
    C = v.chunk
    T = 2 * C + 3
    ids = v.ids(2, T)
    with torch.no_grad():  # two fp32 programs of different orders: the floor of a prefill over these ids
        v.rounding(ids, *v.model(torch.from_numpy(ids)))
    lb, sb = v.held("logits"), v.held("state")
    p_state = session.new_state(2)
    p_logits = session.prefill(ids, p_state)
    d_state = session.new_state(2)
    worst, where = parity.NONE, ""
    for t in range(T):
        d_logits = session.decode(ids[:, t : t + 1], d_state)
        e = errors_or_inf(d_logits[:, 0], p_logits[:, t])
        worst = worst.worst(e)
        if not where and not parity.within(e, lb):
            where = f"first diverging position {t}: logits {said_errors(e)}"
    state_rel, bad = v.compare_states(d_state.numpy(), from_numpy(v.specs, p_state.numpy()), sb)
    where = where or bad
    v.add(Check.of("graphs", f"prefill({T}) == {T} decode steps", not where, worst, lb, where))

    whole_state = session.new_state(2)
    whole = session.prefill(ids, whole_state)
    split_state = session.new_state(2)
    a = session.prefill(ids[:, : C + 2], split_state)
    b = session.prefill(ids[:, C + 2 :], split_state)
    e = errors_or_inf(np.concatenate([a, b], axis=1), whole)
    _, bad = v.compare_states(split_state.numpy(), from_numpy(v.specs, whole_state.numpy()), sb)
    ok = parity.within(e, lb) and not bad
    v.add(Check.of("graphs", "prefill(a); prefill(b, state) == prefill(a+b)", ok, e, lb,
                      "" if ok else (bad or f"logits out of budget: {said_errors(e)}")))


def ragged_agrees(v: Validator, session: Session) -> None:
    """A ragged export (the manifest's ``lengths``): prompts of 1, C - 1, C + 1 and 3 C + 5 tokens prefilled
    together == each prompt prefilled alone (last logits, every state row), run two ways: in one call, and
    as a batched Generator runs them (grouped by length at <= 1.25x padding), here in pieces of C + 1
    tokens so that rows end in different pieces."""
    lb, sb = v.held("logits"), v.held("state")
    C = v.chunk
    prompts = [v.ids(1, T)[0] for T in (1, max(C - 1, 1), C + 1, 3 * C + 5)]
    alone = []  # (last logits [1, V], state) of each prompt prefilled alone
    for ids in prompts:
        state = session.new_state(1)
        alone.append((session.prefill(ids[None], state, last_only=True), from_numpy(v.specs, state.numpy())))
    worst, where = parity.NONE, ""
    for how, options in (("one call", {}), (f"grouped, in pieces of {C + 1}", {"chunk": C + 1, "max_padding": 1.25})):
        last, state = session.prefill_batch(prompts, **options)
        batched = state.numpy()
        for b, ids in enumerate(prompts):
            e = errors_or_inf(last[b : b + 1], alone[b][0])
            worst = worst.worst(e)
            _, bad = v.compare_states({name: a[b : b + 1] for name, a in batched.items()}, alone[b][1], sb)
            if not where and (bad or not parity.within(e, lb)):
                where = f"{how}, prompt {b} ({len(ids)} tokens): " + (bad or f"last logits {said_errors(e)}")
    v.add(Check.of("graphs", "ragged prefill == each prompt alone (one call; grouped in pieces)", not where, worst, lb, where))
