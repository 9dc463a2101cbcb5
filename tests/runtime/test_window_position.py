"""A windowed KV cache holds only its window: a state restored from a file, forked or split keeps the positions its
sequence has seen, so a declared context (max_positions) stops it where one run would stop."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgelin.errors import RuntimeInputError
from edgelin.runtime import load
from edgelin.runtime.state import HEADER_KEY, State

WINDOW, CONTEXT, FED = 16, 64, 40


@pytest.fixture(scope="module")
def windowed(exported):
    """A hybrid: layer 1 softmax attention with a KV cache of at most 16 positions, a declared context of 64."""
    return load(exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=WINDOW, max_positions=CONTEXT)[1], provider="cpu")


def _fed(session) -> State:
    state = session.new_state(1)
    session.prefill(np.arange(FED, dtype=np.int64)[None] % 200, state)
    assert state.past == WINDOW and state.seen == FED and session.manifest.max_positions == CONTEXT
    return state


def _refused(session, state) -> None:
    """FED + 30 tokens pass the context of 64: refused, as in one run."""
    with pytest.raises(RuntimeInputError, match="context of 64 positions .* would reach 70"):
        session.prefill(np.zeros((1, 30), np.int64), state)


def test_one_run_refuses_past_the_context(windowed):
    _refused(windowed, _fed(windowed))


def test_a_saved_and_restored_state_keeps_its_positions(windowed, tmp_path):
    _fed(windowed).save(tmp_path / "s.npz")
    restored = windowed.load_state(tmp_path / "s.npz")
    assert restored.past == WINDOW and restored.seen == FED
    _refused(windowed, restored)


@pytest.mark.parametrize("how", ["fork", "rows", "split"])
def test_a_forked_or_split_state_keeps_its_positions(windowed, how):
    state = _fed(windowed)
    other = {"fork": state.fork, "rows": lambda: state.rows([0]), "split": lambda: state.split()[0]}[how]()
    assert other.seen == FED
    _refused(windowed, other)


def test_the_cli_refuses_a_restored_sequence_past_the_context(windowed, tmp_path):
    from click.testing import CliRunner

    from edgelin.cli import main

    out = str(windowed.export_dir)
    run = CliRunner().invoke
    first = run(main, ["generate", out, "-p", "x" * FED, "-n", "1", "--state-out", str(tmp_path / "s.npz"), "--provider", "cpu"])
    assert first.exit_code == 0, first.output
    again = run(main, ["generate", out, "-p", "y" * 30, "-n", "1", "--state-in", str(tmp_path / "s.npz"), "--provider", "cpu"])
    assert again.exit_code != 0 and "context of 64 positions" in again.output and "Traceback" not in again.output, again.output


def _rewrite_header(path, change) -> None:
    with np.load(path) as npz:
        header = json.loads(npz[HEADER_KEY].tobytes())
        arrays = {k: npz[k] for k in npz.files if k != HEADER_KEY}
    change(header)
    np.savez(path, **{HEADER_KEY: np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}, **arrays)


@pytest.mark.parametrize("seen", [3, -1, "40", True])
def test_a_snapshot_whose_positions_cannot_be_is_refused(windowed, tmp_path, seen):
    path = tmp_path / "s.npz"
    _fed(windowed).save(path)
    _rewrite_header(path, lambda h: h.update(seen=seen))
    with pytest.raises(RuntimeInputError, match="malformed header \\('seen' is"):
        windowed.load_state(path)


def test_a_snapshot_written_before_positions_were_recorded_still_loads(windowed, tmp_path):
    path = tmp_path / "s.npz"
    _fed(windowed).save(path)
    _rewrite_header(path, lambda h: h.pop("seen"))
    assert windowed.load_state(path).seen == WINDOW  # all that such a file tells
