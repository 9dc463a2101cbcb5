"""The suite's shared helpers: comparisons (through edgelin.parity, as the product compares), covering grids
for parametrised tests, the run-wide export cache, and the reference inputs of the op-form tests.

    rel_err(got, ref)   max|got - ref| / max|ref|   (edgelin.parity.rel_max: the ops' accuracy measure)
    max_abs(got, ref)   max|got - ref|              (edgelin.parity.errors: the logits budgets' first bound)
    rel_l2(got, ref)    |got - ref|_2 / |ref|_2     (edgelin.parity.errors: the budgets' second bound)
    assert_within(got, ref, bounds, what)   every bound of a parity budget holds, or an error naming both
"""

from __future__ import annotations

from typing import Mapping

from edgelin import parity
from edgelin.parity import rel_max as rel_err


def _arrays(got, ref):
    return tuple(x.detach().cpu().double().numpy() if hasattr(x, "detach") else x for x in (got, ref))


def max_abs(got, ref) -> float:
    return parity.errors(*_arrays(got, ref)).max_abs


def rel_l2(got, ref) -> float:
    return parity.errors(*_arrays(got, ref)).rel_l2


def assert_within(got, ref, bounds: Mapping[str, float], what: str) -> None:
    """``got`` against ``ref`` within a parity budget (``edgelin.parity.budget(precision, kind)``)."""
    err = parity.errors(*_arrays(got, ref))
    assert parity.within(err, bounds), (
        f"{what}: max abs {err.max_abs:.2e} (max rel {err.max_rel:.2e}), rel L2 {err.rel_l2:.2e}, {err.nonfinite} non-finite; budget {dict(bounds)}"
    )


__all__ = ["assert_within", "max_abs", "rel_err", "rel_l2"]
