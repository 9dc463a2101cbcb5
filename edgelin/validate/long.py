"""Check 6: a long decode stream against the float64 PyTorch model (the drift curve, non-finite values), and a
growing state (a KV cache, with every other state) after long prompts against it."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from edgelin import parity
from edgelin.runtime.session import Session
from edgelin.state import fresh_state
from edgelin.validate.report import NA, Check
from edgelin.validate.validator import Validator, errors_or_inf, nonfinite_note, said_errors

REF_LOGITS_BYTES = 256 << 20  # the float64 reference's logits held at once in the long-prompt (kv) checks


# ---- 6. long stream vs float64 -------------------------------------------------------------
def long_stream(v: Validator, session: Session, steps: int) -> list[dict[str, float]]:
    lb = v.held("long")
    model64 = v.model64()
    ids = v.ids(1, steps)
    state = session.new_state(1)
    ref_state = fresh_state(v.specs, 1, dtype=torch.float64)
    marks = sorted({min(steps, int(round(x))) for x in np.geomspace(1, steps, 25)} | {steps})
    curve, worst, nonfinite, where = [], parity.NONE, "", ""
    t0 = time.perf_counter()
    for t in range(steps):
        logits = session.decode(ids[:, t : t + 1], state)
        with torch.no_grad():
            ref, ref_state = model64.step(torch.from_numpy(ids[:, t : t + 1]), ref_state)
        if not nonfinite and not np.isfinite(logits).all():
            nonfinite = f"non-finite logits at step {t}"
        e = errors_or_inf(logits, ref.numpy())
        worst = worst.worst(e)
        if not where and not parity.within(e, lb):
            where = f"first step out of budget: {t} ({said_errors(e)})"
        if t + 1 in marks:
            finite_states = all(np.isfinite(v).all() for v in state.numpy().values())
            if not finite_states and not nonfinite:
                nonfinite = f"non-finite state by step {t}"
            curve.append({"step": t + 1, "max_abs": worst.max_abs, "max_rel": worst.max_rel, "rel_l2": worst.rel_l2, "step_max_abs": e.max_abs})
        if (t + 1) % 2000 == 0:
            v.say(f"  long stream: {t + 1}/{steps} steps ({time.perf_counter() - t0:.0f} s), max abs so far {worst.max_abs:.2e}")
    where = nonfinite or where
    v.add(Check.of("long", f"{steps} steps vs float64", not where, worst, lb, where))
    return curve


# ---- 6b. a growing state (KV cache) after long prompts vs float64 ------------------------------
def kv_cache(v: Validator, session: Session, lengths: Sequence[int]) -> None:
    """A model with a KV cache: a prompt of each length prefilled through the graphs in the runtime's pieces; every
    state (the caches: keys after RoPE, values; and the linear layers' states) against the float64 PyTorch model
    run over the same ids in pieces (its attention is SDPA in float64), and the last position's logits (the
    long-stream budget). Lengths past the model's declared context are not run (n/a, saying why)."""
    sb, lb = v.held("state"), v.held("long")
    model64 = v.model64()
    # the float64 model's pieces: its logits of a piece are piece x V float64 values (2 GB at 1,024 x 248k, where a
    # Qwen3.5-0.8B's validate was killed for memory); at most REF_LOGITS_BYTES of them
    piece = max(1, min(v.manifest.prefill_piece, REF_LOGITS_BYTES // (8 * v.manifest.vocab_size)))
    for L in lengths:
        name = f"{L:,} tokens prefilled vs float64"
        limit = v.manifest.max_positions
        if limit is not None and L > limit:
            v.add(Check("kv", name, NA, where=f"past the model's context of {limit:,} positions (max_positions)"))
            continue
        ids = v.ids(1, L)
        state = session.new_state(1)
        last = session.prefill(ids, state, last_only=True)  # the runtime's default: pieces of prefill_piece
        ref_state = fresh_state(v.specs, 1, dtype=torch.float64)
        held_state = None if v.quantised is None else fresh_state(v.specs, 1)
        with torch.no_grad():
            for a in range(0, L, piece):
                ref, ref_state = model64(torch.from_numpy(ids[:, a : a + piece]), ref_state)
            # the export's arithmetic in fp32, in the runtime's pieces (int8 per channel rounds a call's activations
            # with one scale: the pieces are part of what it computes)
            for a, b in session._pieces(L, None) if held_state is not None else ():
                held_state = v.quantised(torch.from_numpy(ids[:, a:b]), held_state)[1]
        e = errors_or_inf(last, ref[:, -1].numpy())
        state_rel, bad_state = v.compare_states(state.numpy(), ref_state if held_state is None else held_state, sb)
        ok = parity.within(e, lb) and not bad_state
        where = "" if ok else (nonfinite_note(last, "ORT logits") or bad_state or f"last logits out of budget: {said_errors(e)}")
        v.add(Check.of("kv", name, ok, e, {**lb, "state_rel_l2": sb["rel_l2"]}, where))
