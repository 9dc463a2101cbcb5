"""The suite's cache of CPython's frame-stack chunks (testkit.stackchunks): installed in every test process where
a C compiler exists, and it does absorb the map-per-call pattern of CPython 3.11 (gh-142183)."""

from __future__ import annotations

import platform
import sys

import pytest

from testkit import stackchunks

needed = platform.python_implementation() == "CPython" and sys.version_info >= (3, 11)


@pytest.mark.skipif(not needed, reason="only CPython 3.11+ keeps frames in chunks")
def test_installed_in_this_test_process():
    status = stackchunks.install()
    if "no C compiler" in status:
        pytest.skip(status)
    assert stackchunks.installed(), status


def _call_at_depth(depth: int, calls: int) -> int:
    if depth:
        return _call_at_depth(depth - 1, calls)
    total = 0
    for i in range(calls):
        total += _leaf(i)
    return total


def _leaf(i: int) -> int:
    a, b, c, d, e, f, g, h = i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7  # a frame of some size
    return a + b + c + d + e + f + g + h - 8 * i - 28


@pytest.mark.skipif(not needed, reason="only CPython 3.11+ keeps frames in chunks")
def test_calls_at_a_chunk_edge_reuse_one_block():
    """A loop of calls at every depth up to 400 frames: at the depths where the callee starts a new chunk CPython
    3.11 maps and unmaps one per call (about 1,400 times here); with the cache nearly all are handed out
    again from it, the results unchanged."""
    if not stackchunks.installed():
        pytest.skip(stackchunks.install())
    hits0, maps0 = stackchunks.counts()
    for depth in range(400):
        assert _call_at_depth(depth, 300) == 0
    hits, maps = stackchunks.counts()
    assert hits - hits0 >= 300, (hits - hits0, maps - maps0)  # at least one depth sat on a chunk's edge
    assert maps - maps0 <= (hits - hits0) / 50, (hits - hits0, maps - maps0)


@pytest.mark.skipif(not needed, reason="only CPython 3.11+ keeps frames in chunks")
def test_threads_that_start_and_end_share_the_cache():
    """Each thread has its own frame stack, freed when it ends: eight threads at a time, 32 in all, each calling at
    every depth up to 150, give the right results and leave the cache consistent (the test after them still runs)."""
    import threading

    if not stackchunks.installed():
        pytest.skip(stackchunks.install())
    results: list[int] = []

    def work() -> None:
        results.append(sum(_call_at_depth(depth, 20) for depth in range(150)))

    for _ in range(4):
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert results == [0] * 32
    assert _call_at_depth(200, 1000) == 0
