"""Covering grids for parametrised tests: every value of every axis, every pair of values of any two axes
(a pairwise covering array), and the full product of chosen groups of axes (the edge cases), instead of the
full product of all axes.

    rows = covering(axes, allowed=None, full=(), pin=())   -> list of dicts, deterministic

``axes`` maps an axis name to its values (hashable). ``allowed(row)`` may exclude combinations (a constraint);
a pair, or a group combination, that no allowed row contains is not required. ``full`` lists groups of axes
whose every combination (the allowed ones) must appear, e.g. ("form", "T", "with_state") so that every form
sees every awkward length from a fresh and a carried state. ``pin`` lists whole rows that must be included.

The grid is built greedily over the allowed product (each step takes the row covering the most uncovered
requirements, ties to the earliest row in product order), so it is the same on every machine and every xdist
worker. ``uncovered(rows, axes, ...)`` recomputes what a grid misses, for the tests of the grid itself.
"""

from __future__ import annotations

import itertools
from typing import Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

Row = dict[str, Hashable]


def _requirements(names: Sequence[str], full: Iterable[Sequence[str]]) -> list[tuple[str, ...]]:
    groups = [tuple(pair) for pair in itertools.combinations(names, 2)]
    for group in full:
        unknown = set(group) - set(names)
        if unknown:
            raise ValueError(f"full group {tuple(group)} names unknown axes {sorted(unknown)}")
        groups.append(tuple(group))
    return groups


def _product(axes: Mapping[str, Sequence[Hashable]], allowed: Callable[[Row], bool] | None) -> list[Row]:
    names = list(axes)
    rows = [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]
    return [r for r in rows if allowed is None or allowed(r)]


def _incidence(rows: list[Row], groups: list[tuple[str, ...]]) -> tuple[np.ndarray, list[tuple]]:
    """rows x requirements boolean matrix; a requirement is (group, values) that some row contains."""
    index: dict[tuple, int] = {}
    cells: list[list[int]] = []
    for row in rows:
        ids = []
        for group in groups:
            key = (group, tuple(row[a] for a in group))
            ids.append(index.setdefault(key, len(index)))
        cells.append(ids)
    matrix = np.zeros((len(rows), len(index)), dtype=bool)
    for i, ids in enumerate(cells):
        matrix[i, ids] = True
    return matrix, list(index)


def covering(
    axes: Mapping[str, Sequence[Hashable]],
    *,
    allowed: Callable[[Row], bool] | None = None,
    full: Iterable[Sequence[str]] = (),
    pin: Iterable[Mapping[str, Hashable]] = (),
) -> list[Row]:
    """The rows of a covering grid (see the module docstring), in product order."""
    names = list(axes)
    rows = _product(axes, allowed)
    if not rows:
        raise ValueError("no allowed combination of the axes")
    matrix, _ = _incidence(rows, _requirements(names, list(full)))
    position = {tuple(r[n] for n in names): i for i, r in enumerate(rows)}
    chosen: list[int] = []
    for p in pin:
        key = tuple(p[n] for n in names)
        if key not in position:
            raise ValueError(f"pinned row {dict(p)} is not an allowed combination")
        chosen.append(position[key])
    covered = matrix[chosen].any(axis=0) if chosen else np.zeros(matrix.shape[1], dtype=bool)
    while not covered.all():
        gains = matrix[:, ~covered].sum(axis=1)
        best = int(gains.argmax())  # the first row with the largest gain
        chosen.append(best)
        covered |= matrix[best]
    return [rows[i] for i in sorted(set(chosen))]


def uncovered(
    rows: Sequence[Mapping[str, Hashable]],
    axes: Mapping[str, Sequence[Hashable]],
    *,
    allowed: Callable[[Row], bool] | None = None,
    full: Iterable[Sequence[str]] = (),
) -> list[tuple]:
    """The requirements (group, values) that some allowed row has and none of ``rows`` does."""
    groups = _requirements(list(axes), list(full))
    _, needed = _incidence(_product(axes, allowed), groups)
    have = {(g, tuple(r[a] for a in g)) for r in rows for g in groups}
    return [req for req in needed if req not in have]


def ident(row: Mapping[str, Hashable], labels: Mapping[str, Callable[[Hashable], str]] | None = None) -> str:
    """A test id: the row's values joined by '-', each through its label function if one is given."""
    labels = labels or {}
    return "-".join(labels.get(name, str)(value) for name, value in row.items())


__all__ = ["covering", "ident", "uncovered"]
