"""Property-based fuzzing of the two readers of untrusted files: the manifest and the state snapshot.

Any mutated input either loads (and then runs: a fresh state, a prefill, a decode step) or raises an
EdgelinError -- never another exception.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import zipfile

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgelin.errors import EdgelinError  # noqa: E402
from edgelin.runtime import Manifest, State, load  # noqa: E402

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def _paths(d, prefix=()):
    """Every key path into a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated_manifests(draw, base: dict):
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(d) if p]
        path = draw(st.sampled_from(paths))
        parent = d
        for k in path[:-1]:
            parent = parent[k]
        action = draw(st.sampled_from(["replace", "delete", "retype"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "retype":
            v = parent[path[-1]]
            parent[path[-1]] = [v] if not isinstance(v, list) else (v[0] if v else {})
        else:
            parent[path[-1]] = draw(json_values)
    return d


def _runs(export_dir) -> None:
    session = load(export_dir, provider="cpu")
    state = session.new_state(1)
    session.prefill(np.array([[1, 2, 3]]), state)
    session.decode(np.array([[4]]), state)


@pytest.fixture(scope="module")
def base_manifest(exported):
    return json.loads((exported("elu+1")[1] / "edgelin.json").read_text())


def test_mutated_manifest_dicts_load_or_raise_edgelin_errors(base_manifest):
    @settings(max_examples=400, **SETTINGS)
    @given(mutated_manifests(base_manifest))
    def check(d):
        try:
            m = Manifest.from_dict(d)
        except EdgelinError:
            return
        try:
            State.fresh(m, 1)  # the specs it accepted make a state (or are refused as too big)
            m.to_json()
        except EdgelinError:
            pass

    check()


def test_mutated_manifests_on_disk_load_and_run_or_raise(exported, base_manifest, tmp_path):
    src = exported("elu+1")[1]
    work = tmp_path / "e"
    shutil.copytree(src, work)

    @settings(max_examples=40, **SETTINGS)
    @given(mutated_manifests(base_manifest))
    def check(d):
        (work / "edgelin.json").write_text(json.dumps(d))
        try:
            _runs(work)
        except EdgelinError:
            pass

    check()


def test_mutated_manifest_bytes_load_or_raise(exported, tmp_path):
    src = exported("elu+1")[1]
    work = tmp_path / "e"
    shutil.copytree(src, work)
    raw = (src / "edgelin.json").read_bytes()

    @settings(max_examples=300, **SETTINGS)
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=4), st.integers(1, len(raw)))
    def check(flips, keep):
        data = bytearray(raw[:keep])
        for at, value in flips:
            if at < len(data):
                data[at] = value
        (work / "edgelin.json").write_bytes(bytes(data))
        try:
            Manifest.load(work)
        except EdgelinError:
            pass

    check()


# ---- state snapshots -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def snapshot(exported, tmp_path_factory):
    session = load(exported("elu+1")[1], provider="cpu")
    state = session.new_state(1)
    session.prefill(np.array([[5, 6, 7]]), state)
    path = tmp_path_factory.mktemp("snap") / "s.npz"
    state.save(path)
    return session, path.read_bytes()


def _try_state(session, path) -> None:
    try:
        state = session.load_state(path, batch=1)
    except EdgelinError:
        return
    session.decode(np.array([[1]]), state)  # a state that loads also runs


def test_mutated_state_bytes_load_or_raise(snapshot, tmp_path):
    session, raw = snapshot
    path = tmp_path / "s.npz"

    @settings(max_examples=300, **SETTINGS)
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=6), st.integers(0, len(raw)))
    def check(flips, keep):
        data = bytearray(raw[:keep])
        for at, value in flips:
            if at < len(data):
                data[at] = value
        path.write_bytes(bytes(data))
        _try_state(session, path)

    check()


def _members(raw: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return {n: z.read(n) for n in z.namelist()}


def test_mutated_state_headers_and_arrays_load_or_raise(snapshot, tmp_path):
    session, raw = snapshot
    path = tmp_path / "s.npz"
    with np.load(io.BytesIO(raw)) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(arrays["__edgelin_state__"].tobytes())
    arrays_strategy = st.sampled_from(["drop", "nan", "dtype", "shape", "extra", "scalar", "header"])

    @settings(max_examples=150, **SETTINGS)
    @given(arrays_strategy, st.sampled_from(sorted(k for k in arrays if k != "__edgelin_state__")), st.sampled_from(sorted(header)), json_values)
    def check(how, key, field, value):
        a = {k: v.copy() for k, v in arrays.items()}
        if how == "drop":
            del a[key]
        elif how == "nan":
            a[key] = a[key].astype(np.float32)
            a[key].flat[0] = np.nan
        elif how == "dtype":
            a[key] = a[key].astype(np.float64)
        elif how == "shape":
            a[key] = a[key][..., :1]
        elif how == "extra":
            a["state.99.x"] = np.zeros(2)
        elif how == "scalar":
            a[key] = np.float32(0)
        else:
            h = dict(header)
            h[field] = value
            a["__edgelin_state__"] = np.frombuffer(json.dumps(h).encode(), np.uint8)
        np.savez(path, **a)
        _try_state(session, path)

    check()


def test_an_intact_snapshot_still_loads(snapshot, tmp_path):
    session, raw = snapshot
    path = tmp_path / "s.npz"
    path.write_bytes(raw)
    state = session.load_state(path, batch=1)
    assert state.batch == 1 and set(_members(raw)) >= {"__edgelin_state__.npy"}
