"""The covering grids of the op-form suites (testkit.covering): what they promise is what they hold.

Every value of every axis and every pair of values appears; the groups named in full appear in every
combination; the constraint (the decayed suite's long length) is respected; and the grid builder itself
finds a missing pair when one is taken out.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from testkit.covering import covering, uncovered

HERE = Path(__file__).parent


def _suite(name: str):
    spec = importlib.util.spec_from_file_location(f"_grid_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suite", ["test_forms", "test_decay"])
def test_suite_grid_covers_every_pair_and_its_full_groups(suite):
    m = _suite(suite)
    allowed = getattr(m, "allowed", None)
    assert not uncovered(m.GRID, m.AXES, allowed=allowed, full=m.FULL)
    for axis, values in m.AXES.items():  # every single value of every axis, as the full product had
        assert {r[axis] for r in m.GRID} == set(values), axis
    if allowed is not None:
        assert all(allowed(r) for r in m.GRID)
    product = [dict(zip(m.AXES, v)) for v in itertools.product(*m.AXES.values())]
    product = [r for r in product if allowed is None or allowed(r)]
    assert len(m.GRID) < len(product) / 10, f"{len(m.GRID)} of {len(product)}"


def test_grid_finds_a_missing_pair():
    axes = {"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False)}
    grid = covering(axes)
    assert not uncovered(grid, axes)
    pairs = len(grid)
    assert 6 <= pairs < 12  # 3 x 2 at least, fewer than the product
    dropped = grid[1:]
    assert uncovered(dropped, axes), "removing a row of a greedy grid must lose a requirement"


def test_grid_full_groups_constraints_and_pins():
    axes = {"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False), "d": (5, 6)}
    grid = covering(axes, full=[("a", "b", "c")], allowed=lambda r: not (r["a"] == 2 and r["d"] == 6), pin=[{"a": 0, "b": "y", "c": True, "d": 6}])
    assert {(r["a"], r["b"], r["c"]) for r in grid} == set(itertools.product((0, 1, 2), ("x", "y"), (True, False)))
    assert all(not (r["a"] == 2 and r["d"] == 6) for r in grid)
    assert {"a": 0, "b": "y", "c": True, "d": 6} in grid
    with pytest.raises(ValueError, match="not an allowed"):
        covering(axes, allowed=lambda r: r["d"] == 5, pin=[{"a": 0, "b": "y", "c": True, "d": 6}])
    with pytest.raises(ValueError, match="unknown axes"):
        covering(axes, full=[("a", "z")])
    assert covering(axes) == covering(axes)  # deterministic: every xdist worker collects the same ids
