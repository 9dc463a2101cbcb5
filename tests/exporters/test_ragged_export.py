"""Ragged prefill through the exported graph and the Python runtime: ``export(..., ragged=True)`` gives the
prefill graph a ``lengths`` input, ``Session.prefill_batch`` runs prompts of different lengths in one call,
and each row's last logits, state and following decode steps are those of the row prefilled alone.

Budgets: fp32 from edgelin.parity.BUDGETS (logits max abs 1e-4, rel L2 1e-5; float states rel L2 1e-5;
int64 states equal). The PyTorch side of ragged prefill is tested in float64 in tests/test_ragged.py.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch

from edgelin.config import ModelConfig
from edgelin.errors import ExportError, ManifestError, RuntimeInputError
from edgelin.exporters import export
from edgelin.model import LinearLM
from edgelin.parity import budget, errors, within
from edgelin.runtime import Generator, load
from edgelin.runtime.manifest import MANIFEST_FILE, Manifest, sync_io

C = 8  # chunk of the exported models
VOCAB = 64
ROW_LENGTHS = (1, C - 1, C, C + 1, 3 * C + 5)
LOGITS, STATE = budget("fp32", "logits"), budget("fp32", "state")

# name -> (feature map, conv size, decay); together: the bundled model's kind, no conv, decay none / fixed /
# scalar / gla, cosFormer (an int64 position state), and elu+1 with its denominator (phi(0) = 1, not 0)
CONFIGS = {
    "bundled-relu-conv4-scalar": ("relu", 4, "scalar"),
    "elu1-no-conv-decay-none": ("elu+1", 0, "none"),
    "cosformer-conv4-fixed": ("cosformer", 4, "fixed"),
    "relu-conv2-gla": ("relu", 2, "gla"),
}
CASES = [pytest.param(name, id=name) for name in CONFIGS]


def tiny(name: str) -> LinearLM:
    fm, conv, decay = CONFIGS[name]
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, head_dim=8, chunk_size=C, feature_map=fm,
        conv_size=conv, decay=decay, cosformer_horizon=64, gate_rank=4,
    )
    torch.manual_seed(0)
    model = LinearLM(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(8.0)  # sharper weights: varied logits and gates well below 1
            elif pname.endswith("conv.weight"):
                p.add_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def exports(export_of):
    """(name, ragged) -> (model, export dir), each exported once per run (shared: copy before changing)."""
    models = {}

    def get(name: str, ragged: bool = True, **options):
        if name not in models:
            models[name] = tiny(name)
        model = models[name]
        # the ragged smoke check feeds a padded row
        out = export_of(model, {"ragged_tiny": name}, label=f"ragged-{name}", check=ragged, ragged=ragged, **options)
        return model, out

    return get


def prompts(seed: int, lengths=ROW_LENGTHS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, L) for L in lengths]


def assert_logits(got, ref, what):
    e = errors(np.asarray(got), np.asarray(ref))
    assert within(e, LOGITS), f"{what}: max abs {e.max_abs:.2e}, rel L2 {e.rel_l2:.2e} (budget {LOGITS})"


def assert_state_row(batched: dict, b: int, alone: dict, what: str):
    """Row b of a batched state (runtime arrays by input name) against a batch-1 state."""
    assert set(batched) == set(alone)
    for name, a in alone.items():
        got = batched[name][b]
        if a.dtype == np.int64:
            assert np.array_equal(got, a[0]), f"{what}: {name} {got} != {a[0]}"
        else:
            e = errors(got, a[0])
            assert within(e, STATE), f"{what}: {name} rel L2 {e.rel_l2:.2e} (budget {STATE})"


def torch_state_row(state: dict, b: int) -> dict:
    return {f"state.{k}": t[b : b + 1].numpy() for k, t in state.items()}


@pytest.mark.parametrize("name", CASES)
def test_one_ragged_call_equals_each_prompt_alone(exports, name):
    """One prefill call for 5 prompts of 1, C - 1, C, C + 1, 3 C + 5 tokens: each row's last logits and state
    equal the runtime's prefill of that prompt alone and PyTorch's forward of it alone; then 3 batched decode
    steps equal each row's own decode steps."""
    model, out = exports(name)
    session = load(out, provider="cpu", threads=1)
    assert session.ragged_fallback is None and session.manifest.lengths == "lengths"
    rows = prompts(1)
    calls = []
    run = session._run
    session._run = lambda graph, *a, **kw: calls.append(graph) or run(graph, *a, **kw)
    last, state = session.prefill_batch(rows)
    session._run = run
    assert calls == ["prefill"], "the whole batch should take one prefill call"
    assert last.shape == (len(rows), VOCAB) and state.batch == len(rows)
    batched = state.numpy()
    nxt = np.random.default_rng(2).integers(0, VOCAB, (len(rows), 3))
    steps = [session.decode(nxt[:, t : t + 1], state)[:, 0] for t in range(3)]  # 3 x [B, V]
    for b, ids in enumerate(rows):
        alone = session.new_state(1)
        ref = session.prefill(ids[None], alone, last_only=True)[0]  # [V]
        assert_logits(last[b], ref, f"row {b} (length {len(ids)}): last logits vs the runtime alone")
        assert_state_row(batched, b, alone.numpy(), f"row {b} (length {len(ids)}) vs the runtime alone")
        with torch.no_grad():
            tlogits, tstate = model(torch.from_numpy(ids)[None])
        assert_logits(last[b], tlogits[0, -1].numpy(), f"row {b}: last logits vs PyTorch alone")
        assert_state_row(batched, b, torch_state_row(tstate, 0), f"row {b} vs PyTorch alone")
        for t in range(3):
            got = session.decode(nxt[b : b + 1, t : t + 1], alone)[0, 0]
            assert_logits(steps[t][b], got, f"row {b}: decode step {t} after the ragged prefill")


@pytest.mark.parametrize("chunk", [pytest.param(5, id="piece5"), pytest.param(C, id="piece-chunk")])
def test_ragged_in_pieces_from_a_given_state(exports, chunk):
    """Pieces shorter than most prompts (rows run out of tokens in different pieces, length 0 in later ones),
    starting from a mid-sequence state: the same as each prompt alone."""
    model, out = exports("cosformer-conv4-fixed")
    session = load(out, provider="cpu", threads=1)
    rows = prompts(3, (C + 1, 2, 3 * C + 5, C))
    start = session.new_state(len(rows))
    session.prefill(np.random.default_rng(4).integers(0, VOCAB, (len(rows), 5)), start)  # every row 5 tokens in
    before = start.fork()
    last, state = session.prefill_batch(rows, start, chunk=chunk)
    batched = state.numpy()
    for b, (ids, alone) in enumerate(zip(rows, before.split())):
        ref = session.prefill(ids[None], alone, last_only=True)[0]
        assert_logits(last[b], ref, f"row {b}: last logits")
        assert_state_row(batched, b, alone.numpy(), f"row {b}")
    assert np.array_equal(batched["state.0.pos"], [5 + len(r) for r in rows])


def test_without_padding_the_ragged_graph_gives_the_plain_graphs_results(exports):
    """All lengths equal: the ragged export's prefill gives exactly (bit for bit) the logits and states of the
    export without the input; the decode graphs are the same graph; the plain manifest has no 'lengths'."""
    _, ragged = exports("bundled-relu-conv4-scalar")
    _, plain = exports("bundled-relu-conv4-scalar", ragged=False)
    assert "lengths" not in json.loads((plain / MANIFEST_FILE).read_text())
    decode = [onnx.load(str(out / "decode.onnx")) for out in (ragged, plain)]
    for proto in decode:
        del proto.metadata_props[:]  # the embedded manifests differ (one names lengths), the graphs must not
    assert decode[0].SerializeToString() == decode[1].SerializeToString()
    ids = np.random.default_rng(5).integers(0, VOCAB, (3, 3 * C + 5))
    results = []
    for out in (ragged, plain):
        s = load(out, provider="cpu", threads=1)
        st = s.new_state(3)
        logits = s.prefill(ids, st)
        results.append((logits, st.numpy(), s.decode(ids[:, :1], st)))
    (a, sa, da), (b, sb, db) = results
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(da, db)
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def test_an_export_without_lengths_prefills_one_by_one(exports):
    """An export whose prefill graph takes no lengths loads and runs as before; prefill_batch says why it
    runs the prompts one by one and gives each prompt's own results."""
    model, plain = exports("bundled-relu-conv4-scalar", ragged=False)
    session = load(plain, provider="cpu", threads=1)
    assert session.manifest.lengths is None and "one by one" in session.ragged_fallback
    assert [t["name"] for t in session.manifest.io("prefill")["inputs"]][:3] == ["input_ids", "logits_at", "state.0.S"]
    rows = prompts(6, (3, C + 1))
    last, state = session.prefill_batch(rows)
    for b, ids in enumerate(rows):
        alone = session.new_state(1)
        np.testing.assert_array_equal(last[b], session.prefill(ids[None], alone, last_only=True)[0])
        assert_state_row(state.numpy(), b, alone.numpy(), f"row {b}")
    for bad in (0.5, float("nan"), "x"):  # refused as on a ragged export, though no grouping happens here
        with pytest.raises(RuntimeInputError, match="max_padding"):
            session.prefill_batch(rows, max_padding=bad)


@pytest.mark.parametrize("lengths, calls", [
    pytest.param((C + 3, C + 1, C + 2), 1, id="similar-lengths-one-call"),
    pytest.param((2, 3 * C + 5, 1, C), 4, id="different-lengths-grouped"),
])
def test_batched_generation_prefills_together(exports, lengths, calls):
    """Generator with several prompts prefills them together on a ragged export (prompts of similar lengths
    in one call; lengths far apart in groups, RAGGED_MAX_PADDING), and generates what each prompt generates
    alone (greedy), in prompt order."""
    _, out = exports("bundled-relu-conv4-scalar")
    session = load(out, provider="cpu", threads=1)
    rows = [list(map(int, p)) for p in prompts(7, lengths)]
    seen = []
    run = session._run
    session._run = lambda graph, *a, **kw: seen.append(graph) or run(graph, *a, **kw)
    together = Generator(session, rows, max_new_tokens=6).run()
    session._run = run
    assert seen.count("prefill") == calls
    for b, ids in enumerate(rows):
        alone = Generator(session, [ids], max_new_tokens=6).run()
        assert together.results[b].ids == alone.results[0].ids, f"prompt {b}"


def test_length_groups():
    from edgelin.runtime.session import length_groups

    assert length_groups(np.array([5, 5, 5]), 1.0) == [[0, 1, 2]]
    assert length_groups(np.array([1, 100, 90, 2]), 1.25) == [[1, 2], [3], [0]]  # 200 <= 237.5; 4 > 3.75
    assert length_groups(np.array([1, 100, 90, 2]), 100.0) == [[1, 2, 3, 0]]
    assert length_groups(np.array([3, 1, 2]), 1.0) == [[0], [2], [1]]


@pytest.mark.parametrize("name", ["bundled-relu-conv4-scalar", "cosformer-conv4-fixed"])
def test_out_of_range_lengths_are_clamped_in_the_graph(exports, name):
    """A graph cannot raise on data: a length below 0 means none of the row, above T all of it -- the same
    outputs as 0 and T, not a wrong conv window (negative) or an ONNX Runtime index error (above T)."""
    _, out = exports(name)
    session = load(out, provider="cpu", threads=1)
    graph = session._sessions["prefill"]
    T = C + 3
    ids = np.random.default_rng(3).integers(0, VOCAB, (2, T))
    state = session.new_state(2).numpy()  # {state input name: zeros}

    def run(lengths):
        return graph.run(None, {"input_ids": ids, "lengths": np.array(lengths, dtype=np.int64), **state,
                                **session.manifest.prefill_positions(*ids.shape)})

    for bad, same in (([T, -1], [T, 0]), ([T + 4, 3], [T, 3]), ([-7, 10**9], [0, T])):
        for got, ref in zip(run(bad), run(same)):
            np.testing.assert_array_equal(got, ref, err_msg=f"lengths {bad} vs {same}")


def test_grouped_prefill_keeps_prompt_order(exports):
    """max_padding = 1 (every length its own call): the rows come back in prompt order, each as alone."""
    _, out = exports("relu-conv2-gla")
    session = load(out, provider="cpu", threads=1)
    rows = prompts(9, (3, C + 1, 1, 3 * C + 5, C + 1))
    last, state = session.prefill_batch(rows, max_padding=1.0)
    batched = state.numpy()
    for b, ids in enumerate(rows):
        alone = session.new_state(1)
        assert_logits(last[b], session.prefill(ids[None], alone, last_only=True)[0], f"row {b}")
        assert_state_row(batched, b, alone.numpy(), f"row {b}")
    with pytest.raises(RuntimeInputError, match="max_padding"):
        session.prefill_batch(rows, max_padding=0.5)


def test_prefill_batch_refuses_bad_prompts(exports):
    _, out = exports("bundled-relu-conv4-scalar")
    session = load(out, provider="cpu", threads=1)
    for bad, msg in (([], "non-empty list"), ([[1, 2], []], "prompt 1 must be a non-empty"), ([[1, VOCAB]], "outside the vocabulary"),
                     ([[1.5]], "integer token ids")):
        with pytest.raises(RuntimeInputError, match=msg):
            session.prefill_batch(bad)
    with pytest.raises(RuntimeInputError, match=r"holds 1 sequence\(s\) but there are 2 prompt\(s\); create it with new_state\(2\)"):
        session.prefill_batch([[1], [2]], session.new_state(1))
    with pytest.raises(RuntimeInputError, match="state must be a State"):
        session.prefill_batch([[1], [2]], {"state.0.S": np.zeros(1)})


def test_a_model_without_lengths_is_refused_for_a_ragged_export(tmp_path):
    model = tiny("elu1-no-conv-decay-none")
    for block in model.blocks:  # a model accepts lengths when every layer does: here none does
        block.attn.accepts_lengths = False
    with pytest.raises(ExportError, match="accepts_lengths"):
        export(model, tmp_path / "out", ragged=True)
    assert not (tmp_path / "out").exists()


def test_the_manifest_names_lengths_once_and_only_for_prefill(exports, tmp_path):
    _, out = exports("bundled-relu-conv4-scalar")
    m = Manifest.load(out)
    assert m.io("prefill")["inputs"][1] == {"name": "lengths", "dtype": "int64", "shape": ["batch"]}
    assert "lengths" not in [t["name"] for t in m.io("decode")["inputs"]]
    d = json.loads((out / MANIFEST_FILE).read_text())
    assert Manifest.from_dict(d).lengths == "lengths"
    clash = sync_io(dict(d, lengths="state.0.S"))
    with pytest.raises(ManifestError, match="not unique"):
        Manifest.from_dict(clash)
    with pytest.raises(ManifestError, match="schema"):
        Manifest.from_dict(dict(d, lengths=7))
    stale = dict(d)  # lengths dropped but io still lists it: refused, never half-read
    del stale["lengths"]
    with pytest.raises(ManifestError, match="io.prefill"):
        Manifest.from_dict(stale)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Manifest.from_dict(sync_io(stale)).lengths is None


def test_validate_checks_a_ragged_export(exports):
    """`edgelin validate` adds a ragged check for an export with lengths (and none for one without)."""
    from edgelin.validate import validate

    model, out = exports("cosformer-conv4-fixed")
    report = validate(out, model, steps=8)
    ragged = [c for c in report.checks if c.name.startswith("ragged prefill == each prompt alone")]
    assert [c.status for c in ragged] == ["pass"], report.table()
    assert report.passed, report.table()


def test_validate_runs_ragged_prefill_grouped_and_in_pieces(exports, monkeypatch):
    """The ragged check also runs prompts as a batched Generator does (grouped by length, in pieces): a
    fault only there (here: one row's logits moved when prefill_batch is given pieces) fails it, by name."""
    from edgelin.runtime.session import Session
    from edgelin.validate import validate

    model, out = exports("bundled-relu-conv4-scalar")
    real = Session.prefill_batch

    def faulty(self, prompts, state=None, *, chunk=None, max_padding=None):
        last, state = real(self, prompts, state, chunk=chunk, max_padding=max_padding)
        if chunk is not None:
            last = last.copy()
            last[1] += 1e-2
        return last, state

    monkeypatch.setattr(Session, "prefill_batch", faulty)
    report = validate(out, model, steps=8)
    check = next(c for c in report.checks if c.name.startswith("ragged prefill == each prompt alone"))
    assert check.status == "fail" and f"grouped, in pieces of {C + 1}, prompt 1" in check.where, report.table()


def test_a_ragged_fp16_export(exports, tmp_path):
    """The precision conversion keeps the int64 lengths input: a float16 export with a float16 state
    prefills a ragged batch as each prompt alone, within the fp16 budgets."""
    model, out = exports("bundled-relu-conv4-scalar", precision="fp16", state_dtype="float16")  # smoke-checked on a padded row
    session = load(out, provider="cpu", threads=1)
    assert session.manifest.io("prefill")["inputs"][1] == {"name": "lengths", "dtype": "int64", "shape": ["batch"]}
    rows = prompts(8)
    last, state = session.prefill_batch(rows)
    lb, sb = budget("fp16", "logits"), budget("fp16", "state")
    for b, ids in enumerate(rows):
        alone = session.new_state(1)
        ref = session.prefill(ids[None], alone, last_only=True)[0]
        e = errors(last[b].astype(np.float32), ref.astype(np.float32))
        assert within(e, lb), f"row {b}: {e}"
        for name, a in alone.numpy().items():
            got = state.numpy()[name][b]
            if a.dtype == np.int64:
                assert np.array_equal(got, a[0]), name
            else:
                assert within(errors(got.astype(np.float32), a[0].astype(np.float32)), sb), f"row {b}: {name}"
