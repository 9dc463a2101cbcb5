"""The prefill graph's ``logits_at``: the logits of the asked positions only, the final norm and the head run on
those rows instead of all T (a prompt needs its last one). Checked against the model's own every-position logits
picked by a plain loop, in the model, in the traced module, in the exported graph and through both runtimes' paths
(the Python Session with and without IO binding; an export made without the input, as every earlier one)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import tiny_model
from testkit.protocol import Delegating
from edgelin import parity
from edgelin.exporters.graphs import Graph
from edgelin.protocol import accepts_logits_at, select_positions
from edgelin.runtime import load
from edgelin.runtime.manifest import LOGITS_AT, Manifest, positions_feed
from edgelin.state import fresh_state, to_numpy

C = 16  # tiny_model's chunk


def picked(x: np.ndarray, at: np.ndarray) -> np.ndarray:
    """x [B, T, D] at each row's positions at [B, P], each clamped into [0, T-1]: a loop, in float64."""
    B, T, D = x.shape
    out = np.empty((B, at.shape[1], D), dtype=np.float64)
    for b in range(B):
        for j, p in enumerate(at[b]):
            out[b, j] = x[b, min(max(int(p), 0), T - 1)]
    return out


def awkward_positions(T: int, rng: np.random.Generator, batch: int = 2) -> list[np.ndarray]:
    """The last position; every one; out of order with repeats; beyond both ends (clamped); more positions than T."""
    return [
        positions_feed(batch, T, last=True),
        positions_feed(batch, T),
        rng.integers(0, T, (batch, 5)),
        np.array([[-7, T + 3, T - 1]] * batch),
        rng.integers(0, T, (batch, T + 2)),
    ]


def test_select_positions_is_the_loop():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 7, 5))
    for at in awkward_positions(7, rng):
        got = select_positions(torch.from_numpy(x), torch.from_numpy(at.astype(np.int64))).numpy()
        assert got.shape == (2, at.shape[1], 5)
        assert np.array_equal(got, picked(x, at))


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
@pytest.mark.parametrize("T", [1, C - 1, C, C + 1, 3 * C + 5])
def test_the_skeleton_runs_its_head_on_the_asked_rows_only(T, tied):
    model = tiny_model(tie_embeddings=tied).double()  # float64: the head over P rows and over T rows round alike to ~1e-15
    assert accepts_logits_at(model)
    rows = []
    hook = None if tied else model.lm_head.register_forward_hook(lambda _m, args, _out: rows.append(tuple(args[0].shape)))
    rng = np.random.default_rng(T)
    ids = torch.from_numpy(rng.integers(0, 256, (2, T)))
    try:
        with torch.no_grad():
            full, state = model(ids)
            for at in awkward_positions(T, rng):
                rows.clear()
                got, got_state = model(ids, logits_at=torch.from_numpy(at.astype(np.int64)))
                if not tied:
                    assert rows == [(2, at.shape[1], model.embed.weight.shape[1])]  # the head saw P rows, not T
                assert np.allclose(got.numpy(), picked(full.numpy(), at), rtol=0, atol=1e-12)
                assert all(torch.equal(got_state[k], state[k]) for k in state)  # the state does not depend on it
    finally:
        if hook is not None:
            hook.remove()


class EveryPosition(Delegating):
    """A protocol model that does not declare accepts_logits_at: its graph picks the rows from all T logits."""


@pytest.mark.parametrize("own", [True, False], ids=["model-picks", "graph-picks"])
def test_the_traced_module_gives_the_asked_positions(own):
    inner = tiny_model().double()
    model = inner if own else EveryPosition(inner)
    assert accepts_logits_at(model) is own
    graph = Graph(model, logits_at=True).eval()
    assert graph.own_pick is own
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, 256, (2, C + 1)))
    states = list(fresh_state(model.state_specs(), 2, dtype=torch.float64).values())
    with torch.no_grad():
        full = inner(ids)[0].numpy()
        for at in awkward_positions(C + 1, rng):
            logits = graph(ids, torch.from_numpy(at.astype(np.int64)), *states)[0].numpy()
            assert np.allclose(logits, picked(full, at), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="no logits_at"):
        Graph(model, form="step", logits_at=True)


@pytest.fixture(scope="module")
def both_exports(exported):
    """(model, the export with logits_at, the same model exported without it)"""
    model, new = exported("elu+1")
    _, old = exported("elu+1", options={"logits_at": False})
    return model, new, old


def test_the_manifest_names_the_input_and_its_layout(both_exports):
    _, new, old = both_exports
    m, o = Manifest.load(new), Manifest.load(old)
    assert m.logits_at == LOGITS_AT and o.logits_at is None
    d, e = m.to_dict(), o.to_dict()
    assert d["logits_layout"]["positions"] == "logits_at" and e["logits_layout"]["positions"] == "every"
    assert "positions" in d["symbols"] and "positions" not in e["symbols"]
    assert [t["name"] for t in m.io("prefill")["inputs"][:2]] == ["input_ids", LOGITS_AT]
    assert m.io("prefill")["outputs"][0]["shape"] == ["batch", "positions", 256]
    assert m.io("decode") == o.io("decode")  # the decode graph is the same contract


@pytest.mark.parametrize("T", [1, C - 1, C, C + 1, 3 * C + 5])
def test_the_exported_prefill_graph_gives_the_asked_positions(both_exports, T):
    model, new, _ = both_exports
    m = Manifest.load(new)
    sess = ort.InferenceSession(str(m.graph_path(new, "prefill")), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(T)
    ids = rng.integers(0, 256, (2, T))
    state = fresh_state(model.state_specs(), 2)
    with torch.no_grad():
        full, ref_state = model(torch.from_numpy(ids), state)
    feeds = {m.input_ids: ids, **to_numpy(model.state_specs(), state)}
    names = [m.logits] + [s.output for s in m.states]
    outputs = []
    for at in awkward_positions(T, rng):
        got = sess.run(names, feeds | {m.logits_at: at.astype(np.int64)})
        assert got[0].shape == (2, at.shape[1], 256)
        assert parity.within(parity.errors(got[0], picked(full.numpy(), at)), parity.budget("fp32", "logits"))
        outputs.append(got[1:])
    for later in outputs[1:]:  # the states never depend on the positions asked for
        assert all(np.array_equal(a, b) for a, b in zip(outputs[0], later))
    assert parity.within(parity.errors(outputs[0][0], ref_state[m.states[0].key].numpy()), parity.budget("fp32", "state"))


@pytest.mark.parametrize("binding", [True, False], ids=["io-binding", "run"])
def test_the_session_asks_for_what_it_returns(both_exports, binding):
    """prefill(last_only) through the graph's logits_at, prefill() for every position, prefill_batch's ragged
    last positions: the same as the model and as the export without logits_at."""
    model, new, old = both_exports
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 256, (2, 2 * C + 3))
    with torch.no_grad():
        full = model(torch.from_numpy(ids))[0].numpy()
        alone = [model(torch.from_numpy(ids[b:b + 1, :n]))[0][0, -1].numpy() for b, n in ((0, 5), (1, 2 * C + 3))]
    budget = parity.budget("fp32", "logits")
    results = {}
    for name, folder in (("new", new), ("old", old)):
        s = load(folder, provider="cpu")
        s.io_binding = binding
        every = s.prefill(ids, s.new_state(2), chunk=C)  # 3 pieces: 16, 16, 3 tokens
        last = s.prefill(ids, s.new_state(2), chunk=C, last_only=True)
        batch, _ = s.prefill_batch([ids[0, :5], ids[1]], chunk=C)
        assert every.shape == (2, 2 * C + 3, 256) and last.shape == batch.shape == (2, 256)
        assert parity.within(parity.errors(every, full), budget)
        assert parity.within(parity.errors(last, full[:, -1]), budget)
        assert parity.within(parity.errors(batch, np.stack(alone)), budget)
        results[name] = (every, last, batch)
    for a, b in zip(results["new"], results["old"]):
        assert parity.within(parity.errors(a, b), budget)
