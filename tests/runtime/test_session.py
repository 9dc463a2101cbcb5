"""Session.prefill / decode against PyTorch, IO binding against plain run, chunked prefill, bad ids."""

import numpy as np
import pytest
import torch

from edgelin.errors import RuntimeInputError
from edgelin.parity import BUDGETS
from edgelin.state import from_numpy
from edgelin.runtime import load
from testkit import assert_within, rel_l2

# ORT vs PyTorch, fp32: the project's logits budget
LOGITS = BUDGETS["fp32"]["logits"]
# chunked vs one-shot prefill of the same graph: the budget, not to be loosened
CHUNK_ABS, CHUNK_REL_L2 = 1e-4, 1e-5


def torch_state(state, model):
    """Runtime state -> the model's state dict ("{layer}.{name}" -> tensor), paired by key."""
    return from_numpy(state.manifest.states, state.numpy())


def test_prefill_then_decode_match_pytorch(tiny):
    model, export_dir = tiny
    session = load(export_dir, provider="cpu")
    ids = np.random.default_rng(0).integers(0, 256, (2, 37))
    state = session.new_state(2)
    logits = session.prefill(ids, state)  # [2, 37, V]
    with torch.no_grad():
        ref, ref_state = model(torch.from_numpy(ids))
    assert logits.shape == (2, 37, 256) and logits.dtype == np.float32
    assert_within(logits, ref.numpy(), LOGITS, "logits")
    for step in range(5):
        nxt = ids[:, step:step + 1]
        logits = session.decode(nxt, state)  # [2, 1, V]
        with torch.no_grad():
            ref, ref_state = model.step(torch.from_numpy(nxt), ref_state)
        assert logits.shape == (2, 1, 256)
        assert_within(logits, ref.numpy(), LOGITS, "logits")
    for name, t in torch_state(state, model).items():
        np.testing.assert_allclose(t.numpy(), ref_state[name].numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_io_binding_path_equals_plain_run_path(tiny):
    session = load(tiny[1], provider="cpu")
    ids = np.random.default_rng(1).integers(0, 256, (3, 50))
    bound, plain = session.new_state(3), session.new_state(3)
    session.io_binding = True
    a = [session.prefill(ids[:, :40], bound)]
    session.io_binding = False
    b = [session.prefill(ids[:, :40], plain)]
    for t in range(40, 50):
        session.io_binding = True
        a.append(session.decode(ids[:, t], bound))
        session.io_binding = False
        b.append(session.decode(ids[:, t], plain))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)  # the same kernels on the same inputs: bit for bit
    for (name, x), y in zip(bound.numpy().items(), plain.numpy().values()):
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_io_binding_reuses_two_buffer_sets_and_never_aliases(session):
    state = session.new_state(1)
    session.prefill([[1, 2, 3]], state)
    first = [v.data_ptr() for v in state.values]
    session.decode([4], state)
    second = [v.data_ptr() for v in state.values]
    session.decode([5], state)
    third = [v.data_ptr() for v in state.values]
    assert set(first).isdisjoint(second)  # outputs went to the other buffer set, not the inputs'
    assert third == first  # ... and back: no allocation per step


PAST_HORIZON = pytest.mark.xfail(
    strict=True,
    reason="cosFormer run past twice its horizon (T=5000, M=2048) is ill-conditioned in fp32: measured one-shot "
    "vs chunked max abs 8.7e-4 (rel L2 5.1e-6); vs an fp64 PyTorch reference one-shot ORT is off by 1.5e-3, chunked "
    "by 5.8e-4, PyTorch fp32 itself by 6.4e-4",
)


@pytest.mark.parametrize(
    "feature_map, overrides",
    [
        pytest.param("elu+1", {}, id="elu+1"),
        pytest.param("cosformer", {}, id="cosformer"),  # default horizon 16384 > T
        pytest.param("cosformer", {"cosformer_horizon": 2048}, id="cosformer-past-horizon", marks=PAST_HORIZON),
    ],
)
def test_chunked_prefill_of_a_long_prompt_equals_one_shot(exported, feature_map, overrides):
    """Budget: every logit within 1e-4 absolute and 1e-5 relative L2 of the one-shot prefill."""
    _, export_dir = exported(feature_map, **overrides)
    session = load(export_dir, provider="cpu")
    ids = np.random.default_rng(2).integers(0, 256, (1, 5000))
    one, chunked = session.new_state(1), session.new_state(1)
    full = session.prefill(ids, one, chunk=ids.shape[1])  # [1, 5000, V] in one call
    pieces = session.prefill(ids, chunked, chunk=256)  # 20 pieces, the last one short
    err, rel = float(np.abs(pieces - full).max()), rel_l2(pieces, full)
    assert err <= CHUNK_ABS and rel <= CHUNK_REL_L2, f"max abs {err:.2e}, rel L2 {rel:.2e}"
    for (name, a), b in zip(chunked.numpy().items(), one.numpy().values()):
        if a.dtype == np.int64:
            np.testing.assert_array_equal(a, b, err_msg=name)  # cosformer's position: exactly 5000
        else:
            assert rel_l2(a, b) <= CHUNK_REL_L2, f"{name}: rel L2 {rel_l2(a, b):.2e}"
    last = session.prefill(ids, session.new_state(1), chunk=256, last_only=True)  # [1, V]
    np.testing.assert_array_equal(last, pieces[:, -1])


def test_prefill_goes_in_the_manifests_pieces_unless_told(session, monkeypatch):
    """By default a prompt longer than the manifest's prefill_piece is cut into pieces of that length (as
    generate and the JavaScript runtime do); ``chunk`` sets the piece, ``chunk=T`` is one call."""
    calls = []
    run = session._run
    monkeypatch.setattr(session, "_run", lambda graph, ids, *rest, **kw: calls.append(ids.shape[1]) or run(graph, ids, *rest, **kw))
    piece = session.manifest.prefill_piece
    ids = np.random.default_rng(4).integers(0, 256, (1, 2 * piece + 5))
    default = session.prefill(ids, session.new_state(1), last_only=True)
    assert calls == [piece, piece, 5]
    calls.clear()
    whole = session.prefill(ids, session.new_state(1), chunk=ids.shape[1], last_only=True)
    assert calls == [ids.shape[1]]
    err = float(np.abs(default - whole).max())
    assert err <= CHUNK_ABS and rel_l2(default, whole) <= CHUNK_REL_L2, f"max abs {err:.2e}"


def test_a_long_prefill_then_decode_matches_pytorch(tiny):
    model, export_dir = tiny
    session = load(export_dir, provider="cpu")
    ids = np.random.default_rng(3).integers(0, 256, (1, 700))
    state = session.new_state(1)
    last = session.prefill(ids, state, chunk=128, last_only=True)
    with torch.no_grad():
        ref, ref_state = model(torch.from_numpy(ids))
        ref_next, _ = model.step(torch.tensor([[7]]), ref_state)
    assert_within(last, ref[:, -1].numpy(), LOGITS, "logits")
    assert_within(session.decode([7], state), ref_next.numpy(), LOGITS, "logits")


@pytest.mark.parametrize(
    "ids, match",
    [
        ([[1, 256, 3]], r"token id 256 at position 1 \(sequence 0\) is outside the vocabulary \[0, 256\)"),
        ([[1, 2, -1]], "token id -1 at position 2"),
        ([[1.0, 2.0]], "must be integers"),
        ([[True, False]], "must be integers"),
        (np.zeros((1, 0), np.int64), "empty"),
        ([[1, 2], [3, 4]], r"must be \[batch=1, tokens\]"),
        (np.zeros((1, 2, 3), np.int64), r"must be \[batch=1, tokens\]"),
    ],
    ids=["too-large", "negative", "float", "bool", "empty", "batch", "rank3"],
)
def test_bad_token_ids_are_refused_before_running(session, ids, match):
    state = session.new_state(1)
    before = state.numpy()
    with pytest.raises(RuntimeInputError, match=match):
        session.prefill(ids, state)
    for name, a in state.numpy().items():
        np.testing.assert_array_equal(a, before[name])  # nothing ran


def test_decode_refuses_more_than_one_token_and_out_of_vocab(session):
    state = session.new_state(2)
    with pytest.raises(RuntimeInputError, match="one token per sequence"):
        session.decode([[1, 2], [3, 4]], state)
    with pytest.raises(RuntimeInputError, match="token id 999"):
        session.decode([1, 999], state)
    with pytest.raises(RuntimeInputError, match=r"one token id per sequence: \[batch, 1\] or \[batch\]"):
        session.decode([[1], [1, 2]], state)  # ragged nested lists (numpy's ValueError before)


def test_ragged_nested_ids_are_one_error(session):
    with pytest.raises(RuntimeInputError, match="rectangular"):
        session.prefill([[1, 2, 3], [1, 2]], session.new_state(2))
    with pytest.raises(RuntimeInputError, match=r"prompt 0 must be a flat sequence of token ids, got \[1, \[2\]\]"):
        session.prefill_batch([[1, [2]], [3]])  # numpy's ValueError before
    from edgelin.runtime import Generator, State, generate_text

    for ids in ([[1, 2], [3, [4]]], [[1, [2]], [3]]):  # the Generator's own reading of the prompts (numpy's ValueError before)
        with pytest.raises(RuntimeInputError, match="must be a flat sequence of token ids"):
            list(Generator(session, ids, max_new_tokens=2))
    with pytest.raises(RuntimeInputError, match="State.stack takes a list of states, got NoneType"):
        State.stack(None)  # TypeError before
    with pytest.raises(RuntimeInputError, match=r"prompt 2 of 2 is int 1, not text"):
        generate_text(session, ["a", 1], max_new_tokens=2)  # "is empty" before
    with pytest.raises(RuntimeInputError, match=r"prompt 2 of 2 is list \['b'\], not text"):
        generate_text(session, ["a", ["b"]], max_new_tokens=2)


def test_a_state_of_another_model_is_refused(session, exported):
    other = load(exported("relu")[1], provider="cpu")  # same weights, another feature map
    with pytest.raises(RuntimeInputError, match="belongs to another model"):
        session.prefill([[1, 2]], other.new_state(1))
    with pytest.raises(RuntimeInputError, match="must be a State"):
        session.prefill([[1, 2]], {"state.0.S": np.zeros(1)})


@pytest.mark.parametrize("batch", [0, -1, 1.5, True])
def test_new_state_needs_a_positive_batch(session, batch):
    with pytest.raises(RuntimeInputError, match="batch must be a positive integer"):
        session.new_state(batch)


@pytest.mark.parametrize("io_binding", [True, False], ids=["io-binding", "plain-run"])
def test_an_error_while_onnx_runtime_runs_a_graph_is_one_line_and_the_state_stays(tiny, io_binding):
    """ONNX Runtime failing inside a run (out of memory, a kernel's error) was its own exception type with a
    multi-line message: now one ProviderError naming the graph and the provider; the state has not moved."""
    from edgelin.errors import ProviderError

    session = load(tiny[1], provider="cpu")
    session.io_binding = io_binding
    state = session.new_state(1)
    session.prefill([[1, 2, 3]], state)
    before = {k: v.copy() for k, v in state.numpy().items()}

    class Failing:
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

        def _fail(self, *args, **kwargs):
            raise __import__("onnxruntime").capi.onnxruntime_pybind11_state.Fail(
                "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running MatMul node. Name:'x'\nmore")

        run = run_with_iobinding = _fail

    session._sessions["decode"] = Failing(session._sessions["decode"])
    with pytest.raises(ProviderError) as info:
        session.decode([4], state)
    message = str(info.value)
    assert "\n" not in message and message.startswith("ONNX Runtime failed while running the decode graph on cpu (")
    assert "running MatMul node. Name:'x'" in message
    for name, value in state.numpy().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_prefill_chunk_must_be_positive(session):
    with pytest.raises(RuntimeInputError, match="chunk must be a positive integer"):
        session.prefill([[1, 2]], session.new_state(1), chunk=0)
