"""State: fork, snapshots to .npz and back, rows and stacking, refusals."""

import numpy as np
import pytest

from edgelin.errors import NonFiniteError, OutputError, RuntimeInputError
from edgelin.runtime import State, load

PROMPT = np.frombuffer(b"The state of a linear-attention model has a fixed size.", np.uint8).astype(np.int64)[None]


def run_decode(session, state, tokens):
    return [session.decode([t], state) for t in tokens]  # each [1, 1, V]


def assert_states_equal(a, b):
    for (name, x), y in zip(a.numpy().items(), b.numpy().values()):
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_fork_gives_two_independent_streams(session):
    base = session.new_state(1)
    session.prefill(PROMPT, base)
    branch = base.fork()
    assert_states_equal(branch, base)
    left = run_decode(session, base, [10, 11, 12, 13])
    right = run_decode(session, branch, [20, 21, 22, 23])
    # each branch equals a fresh run of the prompt followed by its own tokens
    for tokens, got in (([10, 11, 12, 13], left), ([20, 21, 22, 23], right)):
        fresh = session.new_state(1)
        session.prefill(PROMPT, fresh)
        for g, w in zip(got, run_decode(session, fresh, tokens)):
            np.testing.assert_array_equal(g, w)
    assert not np.array_equal(left[-1], right[-1])


def test_fork_does_not_share_memory(session):
    base = session.new_state(1)
    session.prefill(PROMPT, base)
    branch = base.fork()
    snapshot = branch.numpy()
    run_decode(session, base, [1, 2, 3])
    for name, a in branch.numpy().items():
        np.testing.assert_array_equal(a, snapshot[name], err_msg=name)


def test_snapshot_restore_continue_equals_an_uninterrupted_run(session, tmp_path):
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    straight = session.new_state(1)
    session.prefill(PROMPT, straight)
    want = run_decode(session, straight, tokens)

    paused = session.new_state(1)
    session.prefill(PROMPT, paused)
    first = run_decode(session, paused, tokens[:3])
    path = paused.save(tmp_path / "chat.npz")
    restored = session.load_state(path, batch=1)
    got = first + run_decode(session, restored, tokens[3:])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert_states_equal(restored, straight)


def test_snapshot_keeps_names_shapes_dtypes_and_identity(session, tmp_path):
    state = session.new_state(3)
    session.prefill(np.repeat(PROMPT, 3, axis=0), state)
    path = state.save(tmp_path / "s.state")  # any file name: no ".npz" is appended
    assert path == tmp_path / "s.state" and path.is_file()
    restored = session.load_state(path)
    assert restored.batch == 3
    assert_states_equal(restored, state)
    assert [p.name for p in tmp_path.iterdir()] == ["s.state"]  # no temporary file left behind


def test_a_snapshot_is_refused_by_another_model(session, exported, tmp_path):
    other = load(exported("relu")[1], provider="cpu")  # same weights and shapes, another feature map
    path = other.new_state(1).save(tmp_path / "relu.npz")
    with pytest.raises(RuntimeInputError, match="saved from another model .*config"):
        session.load_state(path)


def test_a_snapshot_of_another_batch_size_is_refused(session, tmp_path):
    path = session.new_state(2).save(tmp_path / "two.npz")
    with pytest.raises(RuntimeInputError, match="holds 2 sequence\\(s\\) but 1 are needed"):
        session.load_state(path, batch=1)


@pytest.mark.parametrize("content", [b"", b"not a zip file", None], ids=["empty", "garbage", "plain-npz"])
def test_files_that_are_not_snapshots_are_refused(session, tmp_path, content):
    path = tmp_path / "x.npz"
    if content is None:
        np.savez(path, a=np.zeros(3))
    else:
        path.write_bytes(content)
    with pytest.raises(RuntimeInputError, match="is not an edgelin state file"):
        session.load_state(path)


def test_a_missing_snapshot_is_refused(session, tmp_path):
    with pytest.raises(RuntimeInputError, match="does not exist"):
        session.load_state(tmp_path / "nope.npz")


def test_a_failed_save_leaves_nothing_half_written(session, tmp_path, monkeypatch):
    path = tmp_path / "keep.npz"
    session.new_state(1).save(path)  # an earlier snapshot: the one kind of file a save replaces without overwrite=True
    previous = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError, match="disk full"):
        session.new_state(1).save(path)
    assert path.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == ["keep.npz"]


def test_save_into_a_missing_folder_is_refused(session, tmp_path):
    with pytest.raises(OutputError, match="does not exist"):  # as every output path edgelin cannot write
        session.new_state(1).save(tmp_path / "no" / "such.npz")


def test_save_refuses_an_empty_path_and_a_state_that_went_non_finite(session, tmp_path):
    with pytest.raises(RuntimeInputError, match="got an empty one"):
        session.new_state(1).save("")
    state = session.new_state(1)
    arrays = state.numpy()
    first = next(k for k, a in arrays.items() if np.issubdtype(a.dtype, np.floating))
    arrays[first].flat[0] = np.nan
    bad = type(state).from_arrays(session.manifest, arrays)
    with pytest.raises(NonFiniteError, match=f"state {first!r} holds 1 NaN/infinite"):  # load would refuse it
        bad.save(tmp_path / "bad.npz")
    assert list(tmp_path.iterdir()) == []
    # the same check on the way in: a snapshot edited to hold a NaN is refused by load
    path = state.save(tmp_path / "good.npz")
    with np.load(path) as f:
        edited = {k: f[k] for k in f.files}
    edited[first] = arrays[first]
    np.savez(path, **edited)
    with pytest.raises(RuntimeInputError, match=f"state {first!r} holds 1 NaN/infinite value.*start a fresh one"):
        session.load_state(path)


def test_rows_and_stack_round_trip(session):
    a, b = session.new_state(1), session.new_state(1)
    session.prefill(PROMPT, a)
    session.prefill(PROMPT[:, :9], b)
    both = State.stack([a, b])
    assert both.batch == 2
    assert_states_equal(both.rows([1]), b)
    first, second = both.split()
    assert_states_equal(first, a)
    assert_states_equal(second, b)


def test_from_arrays_checks_shapes_and_names(session):
    arrays = session.new_state(1).numpy()
    name = next(iter(arrays))
    with pytest.raises(RuntimeInputError, match=f"state '{name}' is float32"):
        State.from_arrays(session.manifest, {**arrays, name: arrays[name][..., :-1]})
    with pytest.raises(RuntimeInputError, match="missing"):
        State.from_arrays(session.manifest, {k: v for k, v in arrays.items() if k != name})
