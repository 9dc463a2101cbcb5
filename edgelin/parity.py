"""Parity: the one table of error budgets and the one way to measure an error against it.

Torch-free (numpy only): the exporter's smoke check, ``edgelin validate``, the bench's verification and
the tests all compare through this module, so "close enough" has one definition per precision.

    errors(got, ref)              -> Errors(max_abs, rel_l2, nonfinite)   any shapes, any float dtype
    within(err, budget)           -> bool   every bound in the budget holds and nothing is non-finite
    compare(got, ref, budget)     -> [Comparison]   named arrays, paired by name, every pair reported
    agreement(got, ref)           -> top-1 agreement of two logits arrays [..., vocab]
    rel_max(got, ref)             -> max|got - ref| / max|ref|, the ops' accuracy measure (edgelin.ops)
    budget(precision, kind)       -> the bounds for one comparison (ParityError for an unknown one)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from edgelin.errors import EdgelinError

# Budgets per precision and kind of comparison. Bounds are "max_abs" (largest absolute difference),
# "rel_l2" (|got - ref|_2 / |ref|_2) and "min_agreement" (top-1). Every bound listed must hold.
#   logits    ONNX Runtime vs PyTorch (prefill, decode, prefill vs decode)
#   state     recurrent state (S, z, conv): running sums whose scale grows with T, so relative L2 only;
#             int64 states (positions) must be equal
#   provider  one ONNX Runtime provider vs CPU (kernels differ, e.g. CUDA's reduction order)
#   long      a long decode stream vs a float64 PyTorch run (rounding accumulates)
#   top1      teacher-forced top-1 agreement on random ids (near-ties may flip)
#   greedy    64 greedy tokens on 8 held-out prompts, export vs fp32 PyTorch: mean fraction before the first difference
#   heldout   bits/byte on the bundled model's held-out text, export minus fp32 PyTorch, and top-1 agreement there
def _budget(*, logits, state, provider, long, top1, greedy, heldout) -> dict[str, dict[str, float]]:
    """One precision's row: (max abs, rel L2) pairs, a rel L2 for states, minimum agreements, and the
    held-out (bits/byte delta, top-1 agreement) pair."""
    return {
        "logits": {"max_abs": logits[0], "rel_l2": logits[1]},
        "state": {"rel_l2": state},
        "provider": {"max_abs": provider[0], "rel_l2": provider[1]},
        "long": {"max_abs": long[0], "rel_l2": long[1]},
        "top1": {"min_agreement": top1},
        "greedy": {"min_agreement": greedy},
        "heldout": {"max_bpb_delta": heldout[0], "min_agreement": heldout[1]},
    }


BUDGETS: dict[str, dict[str, dict[str, float]]] = {
    "fp32": _budget(
        logits=(1e-4, 1e-5), state=1e-5, provider=(1e-3, 1e-4), long=(1e-3, 1e-4),
        top1=0.99, greedy=1.0, heldout=(1e-4, 0.99),
    ),
    # Budgets set on the previous bundled model (pydoc-linear, no decay), validate seed 0, measured worst ->
    # budget (about 3x, rounded up); each precision's comment ends with the current bundled model
    # (stdlib-linear, decay scalar; validate seed 0, steps 64, long 1000, held-out 7,936 bytes of code).
    # fp16, re-measured after the state inputs stopped round-tripping through fp16 (validate seed 0, steps 64,
    #   long 1000): logits max abs 1.0e-2 / rel L2 2.5e-4 (prefill T=63), decode 6.7e-3 / 4.5e-4, prefill vs
    #   decode 5.5e-4 / 4.0e-5 (before: 1.9e-2 / 8.3e-4); states within 2.5e-3 (value not re-read; before: S 5.2e-4);
    #   1000 steps vs float64 1.2e-2 / 1.0e-3 (before: 3.7e-2 vs fp32); top-1 100 %; greedy 89.8 %; held-out
    #   bits/byte delta +6e-5, top-1 99.96 %. Budgets kept (each at or above 3x these). provider: CUDA not
    #   measured, set to the logits budget.
    #   stdlib-linear: prefill 1.5e-2 / 5.0e-4, decode 1.1e-2 / 1.9e-3, prefill vs decode 1.2e-2 / 1.3e-3, 1000
    #   steps vs float64 3.2e-2 / 5.5e-3 (the rel L2 at 0.55 of its budget), top-1 99.75 %, greedy 100 %,
    #   held-out delta -0.0000, top-1 100 %.
    "fp16": _budget(
        logits=(6e-2, 3e-3), state=2.5e-3, provider=(6e-2, 3e-3), long=(0.15, 1e-2),
        top1=0.98, greedy=0.6, heldout=(2e-3, 0.995),
    ),
    # int8: logits max abs 0.84 (prefill T=197) / rel L2 7.1e-2 (prefill vs decode: activation scales are
    #   per tensor, so they differ between a prompt and a token); state S rel L2 9.7e-3 (layer 0); 1000
    #   steps vs float64 0.26 / 6.5e-2; top-1 95.25 %; greedy 64.1 %; held-out delta +0.0058, top-1 96.41 %.
    #   top-1 on random ids (off the training distribution: near-ties) varies with validate's seed: 90.5-96.0 %
    #   over seeds 0-5, so its bound sits below the worst seed, not at a single measurement.
    #   stdlib-linear: prefill 0.99 / 2.9e-2, decode 0.28 / 5.4e-2, prefill vs decode 0.62 / 0.13, 1000 steps vs
    #   float64 0.31 / 0.16 (the rel L2 at 0.8 of its budget: the thinnest margin of any check), top-1 95.0 %,
    #   greedy 76.2 %, held-out delta +0.0005, top-1 97.49 %.
    #   Since int8 weights use 7 bits (reduce_range; exporters/precision.py: full-range weights saturate ONNX
    #   Runtime's u8 x s8 kernel on AVX2-only CPUs, where the bundled model failed these budgets): the bundled
    #   model passes them at validate steps 8 on an AVX2-only AMD EPYC; the figures above are not re-measured.
    "int8": _budget(
        logits=(2.5, 0.2), state=0.05, provider=(2.5, 0.2), long=(1.0, 0.2),
        top1=0.85, greedy=0.3, heldout=(0.02, 0.92),
    ),
    # int4: logits max abs 1.6 / rel L2 0.12 (decode); prefill vs decode 1.5e-5 (weights only: the two graphs
    #   agree); state S rel L2 0.10; 1000 steps vs float64 1.5 / 0.19; top-1 on random ids 68.5 %; greedy
    #   24.0 %; held-out delta +0.0068, top-1 95.79 %. Top-1 on random ids over validate seeds 0-5: 54.75-78.75 %
    #   (near-ties flip under 4-bit weights); the held-out text's top-1 above is the stable quality measure.
    #   stdlib-linear: prefill 1.65 / 5.1e-2, decode 0.87 / 0.19, prefill vs decode 9.5e-6, 1000 steps vs float64
    #   1.78 / 0.42 (rel L2 at 0.7 of its budget), top-1 88.25 %, greedy 52.5 %, held-out delta +0.0053, top-1 97.66 %.
    "int4": _budget(
        logits=(5.0, 0.4), state=0.3, provider=(5.0, 0.4), long=(4.5, 0.6),
        top1=0.45, greedy=0.1, heldout=(0.02, 0.92),
    ),
}


class ParityError(EdgelinError):
    """No budget for a precision or comparison kind."""


@dataclass(frozen=True)
class Errors:
    max_abs: float
    rel_l2: float
    nonfinite: int = 0  # elements of ``got`` that are NaN or infinite

    def worst(self, other: "Errors") -> "Errors":
        return Errors(max(self.max_abs, other.max_abs), max(self.rel_l2, other.rel_l2), self.nonfinite + other.nonfinite)


NONE = Errors(0.0, 0.0, 0)


@dataclass(frozen=True)
class Comparison:
    name: str
    errors: Errors
    budget: Mapping[str, float]
    passed: bool


def budget(precision: str, kind: str) -> dict[str, float]:
    try:
        table = BUDGETS[precision]
    except KeyError:
        raise ParityError(f"no parity budget for precision {precision!r}; known: {', '.join(BUDGETS)}") from None
    if kind not in table:
        raise ParityError(f"no {kind!r} budget for precision {precision!r}; kinds: {', '.join(table)}")
    return dict(table[kind])


def errors(got, ref) -> Errors:
    """Max abs and relative L2 error of ``got`` against ``ref`` (computed in float64). A shape mismatch or
    a non-finite difference is an infinite error; integer arrays must be equal (0 or infinite)."""
    got, ref = np.asarray(got), np.asarray(ref)
    nonfinite = int(np.size(got) - np.isfinite(got).sum()) if got.dtype.kind == "f" else 0
    if got.shape != ref.shape:
        return Errors(math.inf, math.inf, nonfinite)
    if got.dtype.kind in "iub" and ref.dtype.kind in "iub":
        return NONE if np.array_equal(got, ref) else Errors(math.inf, math.inf, 0)
    diff = got.astype(np.float64) - ref.astype(np.float64)
    if not np.isfinite(diff).all():
        return Errors(math.inf, math.inf, nonfinite)
    norm = float(np.linalg.norm(ref.astype(np.float64)))
    return Errors(float(np.abs(diff).max(initial=0.0)), float(np.linalg.norm(diff)) / max(norm, 1e-30), nonfinite)


def within(err: Errors, bounds: Mapping[str, float]) -> bool:
    return (
        err.nonfinite == 0
        and err.max_abs <= bounds.get("max_abs", math.inf)
        and err.rel_l2 <= bounds.get("rel_l2", math.inf)
    )


def compare(got: Mapping[str, object], ref: Mapping[str, object], bounds: Mapping[str, float]) -> list[Comparison]:
    """Every name of ``ref`` compared with the same name of ``got`` (a missing one fails), in ``ref``'s order."""
    out = []
    for name, r in ref.items():
        err = errors(got[name], r) if name in got else Errors(math.inf, math.inf, 0)
        out.append(Comparison(name, err, dict(bounds), within(err, bounds)))
    return out


def agreement(got, ref) -> float:
    """Fraction of positions where the two logits arrays [..., vocab] have the same argmax. Any non-finite
    logit makes its position disagree (NaN logits must never "agree")."""
    got, ref = np.asarray(got), np.asarray(ref)
    same = got.argmax(-1) == ref.argmax(-1)
    same &= np.isfinite(got).all(-1) & np.isfinite(ref).all(-1)
    return float(same.mean()) if same.size else 1.0


def rel_max(got, ref) -> float:
    """max|got - ref| / max|ref| in float64: the accuracy measure of the ops' contract
    (``edgelin.ops.REFERENCE_TOLERANCE``) and of ``edgelin.state.state_mismatch``. Infinite for a shape
    mismatch or a non-finite difference (NaN is never close); 0 for two empty arrays."""
    got, ref = (np.asarray(x.detach().cpu().double() if hasattr(x, "detach") else x, dtype=np.float64) for x in (got, ref))
    if got.shape != ref.shape:
        return math.inf
    if got.size == 0:
        return 0.0
    diff = np.abs(got - ref).max()
    if not np.isfinite(diff):
        return math.inf
    return float(diff / max(float(np.abs(ref).max()), 1e-300))


__all__ = ["BUDGETS", "Comparison", "Errors", "ParityError", "agreement", "budget", "compare", "errors", "rel_max", "within"]
