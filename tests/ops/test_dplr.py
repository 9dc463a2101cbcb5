"""The generalised delta rule with a diagonal-plus-rank-one transition (RWKV-7's recurrence): every fast form
against the naive float64 reference, the naive form against fla's own pure-PyTorch reference, and the chunk and
step forms exported to ONNX and run in ONNX Runtime.

Inputs: batch 2, H = 2, K = 8, V = 12 (K != V catches a transposed state), chunk C = 16, every sequence from a
carried state (7 tokens through the naive form). Two kinds of rank-one part: RWKV-7's (a = -kk, b = kk * lr with
kk a unit vector and lr in (0, 1) per channel) and a random one (a, b independent directions of norm 0.5). Three
decays: none (w = 0: the state lives longest), RWKV-7's range (w = -exp(-0.5) sigmoid(x), in (-0.61, 0)) and a
strong one (w = -exp(2x) clipped to [-30, 0], with ~20 % of the entries at -30 and ~20 % at -1e-6), so a chunk sees
both extremes per channel.

Tolerances (relative error max|fast - naive| / max|naive| per tensor): float64 1e-12; float32 5e-6. Measured at
these sizes: <= 4e-7 everywhere but the random rank-one part without decay at T = 1000, whose transitions
I + b a^T expand (the state grows ~250x): 6e-7 (chunk) and 1.5e-6 (recurrent). scripts/dplr_accuracy.py prints
the table for K = V = 64.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import edgelin.ops.delta as delta
from edgelin.ops.dplr import (
    DEFAULT_CHUNK,
    DPLR_FORMS,
    chunk_dplr,
    dplr_state_layout,
    dplr_step,
    naive_dplr,
    recurrent_dplr,
)
from testkit.delta import TOLERANCE, check, fla_naive, rel_err

B, H, K, V, C = 2, 2, 8, 12, 16
PREFIX = 7
LENGTHS = (1, C - 1, C, C + 1, 1000)
KINDS = ("rwkv7", "random")
DECAYS = ("none", "rwkv7", "strong")


def make_inputs(T: int, kind: str, decays: str, seed: int, batch: int = B):
    """q, k, v, a, b, w, float64 ([B, H, T, K] except v [B, H, T, V])."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = randn(batch, H, T, K), randn(batch, H, T, K) * K**-0.5
    v = randn(batch, H, T, V)
    if kind == "rwkv7":
        kk = F.normalize(randn(batch, H, T, K), dim=-1)
        a, b = -kk, kk * rand(batch, H, T, K)
    else:
        a, b = 0.5 * F.normalize(randn(batch, H, T, K), dim=-1), 0.5 * F.normalize(randn(batch, H, T, K), dim=-1)
    if decays == "none":
        w = torch.zeros(batch, H, T, K, dtype=torch.float64)
    elif decays == "rwkv7":
        w = -np.exp(-0.5) * torch.sigmoid(2 * randn(batch, H, T, K))
    else:
        r = rand(batch, H, T, K)
        w = torch.where(r < 0.2, -30.0, torch.where(r > 0.8, -1e-6, -torch.exp(2 * randn(batch, H, T, K)).clamp_max(30.0)))
    return q, k, v, a, b, w


@functools.lru_cache(maxsize=None)
def reference(T: int, kind: str, decays: str):
    """(inputs, initial state, o, final state) from the naive form, float64. Callers must not mutate."""
    _, initial = naive_dplr(*make_inputs(PREFIX, kind, decays, seed=1))
    x = make_inputs(T, kind, decays, seed=100 + T)
    o, final = naive_dplr(*x, initial_state=initial)
    return x, initial, o, final


def cast(xs, dtype):
    return tuple(x.to(dtype) for x in xs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("decays", DECAYS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_fast_form_matches_naive(form, kind, decays, T, dtype):
    x, initial, ref_o, ref_state = reference(T, kind, decays)
    o, state = DPLR_FORMS[form](*cast(x, dtype), initial_state={"S": initial["S"].to(dtype)}, chunk_size=C)
    check(o, state, ref_o, ref_state, dtype)


def test_naive_is_the_recurrence_as_written():
    """Two tokens by hand: S1 = diag(e^w1) S0 + b1 (a1^T S0) + k1 v1^T (a reads the state before the decay),
    o = scale S^T q; no initial state is a zero state."""
    x = make_inputs(2, "random", "rwkv7", seed=2)
    S0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    S = S0
    outs = []
    for t in range(2):
        q, k, v, a, b, w = (y[:, :, t] for y in x)  # [B, H, K] / [B, H, V]
        read = torch.einsum("bhk,bhkv->bhv", a, S)  # [B, H, V]: a^T S_{t-1}
        S = w.exp()[..., None] * S + b[..., None] * read[..., None, :] + k[..., None] * v[..., None, :]
        outs.append(0.5 * torch.einsum("bhk,bhkv->bhv", q, S))
    check(*naive_dplr(*x, initial_state={"S": S0}, scale=0.5), torch.stack(outs, dim=2), {"S": S}, torch.float64)
    o, state = naive_dplr(*x)
    check(o, state, *naive_dplr(*x, initial_state={"S": torch.zeros(B, H, K, V, dtype=torch.float64)}), torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_state_and_scale(kind):
    """No initial_state is a zero state in every sequence form; ``scale`` multiplies q."""
    x = make_inputs(2 * C + 3, kind, "strong", seed=3)
    ref_o, ref_state = naive_dplr(*x, initial_state={"S": torch.zeros(B, H, K, V, dtype=torch.float64)})
    for form in ("naive", "chunk", "recurrent"):
        check(*DPLR_FORMS[form](*x, chunk_size=C), ref_o, ref_state, torch.float64)
        o, state = DPLR_FORMS[form](*x, chunk_size=C, scale=0.25)
        check(o, state, 0.25 * ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_step_is_one_token(kind):
    """dplr_step from a carried state is the naive form's first token, keeping the token axis."""
    x, initial, _, _ = reference(C + 1, kind, "strong")
    one = tuple(y[:, :, :1] for y in x)
    o, state = dplr_step(*one, initial_state=initial)
    assert o.shape == (B, H, 1, V)
    check(o, state, *naive_dplr(*one, initial_state=initial), torch.float64)
    with pytest.raises(ValueError, match="one token"):
        dplr_step(*(y[:, :, :2] for y in x))
    with pytest.raises(ValueError, match="lengths"):
        dplr_step(*one, lengths=torch.tensor([1, 1]))


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 64], ids=lambda c: f"C{c}")
def test_chunk_any_chunk_size(chunk_size):
    """T = 53 against chunk sizes 1, 5 (not a power of two: the inverse is padded), 37 and 64 (longer than T)."""
    x, initial, ref_o, ref_state = reference(3 * C + 5, "rwkv7", "strong")
    check(*chunk_dplr(*x, initial_state=initial, chunk_size=chunk_size), ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_state_carried_across_calls(form):
    """Prefill in pieces of 1, C - 1 and C + 1 tokens (cuts inside chunks), then the rest, each from the state the
    last left, is one call over the whole sequence."""
    x, initial, ref_o, ref_state = reference(3 * C + 5, "rwkv7", "rwkv7")
    state, outs, start = initial, [], 0
    for size in (1, C - 1, C + 1, 3 * C + 5 - (2 * C + 1)):
        o, state = DPLR_FORMS[form](*(y[:, :, start : start + size] for y in x), initial_state=state, chunk_size=C)
        outs.append(o)
        start += size
    check(torch.cat(outs, dim=2), state, ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_strongest_decays_stay_finite(dtype):
    """w = -30 on every channel at every step, and w = -30 on half the channels with w ~ 0 on the other half,
    over 300 tokens: no NaN or inf (no exp of a positive number), and still the naive form's result."""
    x = make_inputs(300, "rwkv7", "rwkv7", seed=9)
    half = torch.arange(K) % 2 == 0  # [K]
    initial = {"S": torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(4), dtype=torch.float64)}
    for w in (torch.full_like(x[5], -30.0), torch.where(half, -30.0, -1e-6).expand_as(x[5])):
        xs = (*x[:5], w)
        ref = naive_dplr(*xs, initial_state=initial)
        check(*chunk_dplr(*cast(xs, dtype), initial_state={"S": initial["S"].to(dtype)}, chunk_size=C), *ref, dtype)


@pytest.mark.parametrize("form", ["naive", "chunk"])
def test_lengths_ragged(form):
    """Right-padded rows of different lengths: each row's output (at its real tokens) and state are those of
    the row alone; a length of 0 keeps the state."""
    T = 2 * C + 3
    x = make_inputs(T, "rwkv7", "strong", seed=21, batch=3)
    _, initial = naive_dplr(*make_inputs(PREFIX, "rwkv7", "strong", seed=22, batch=3))
    lengths = torch.tensor([T, C + 1, 0])
    o, state = DPLR_FORMS[form](*x, initial_state=initial, chunk_size=C, lengths=lengths)
    for row, n in enumerate(lengths.tolist()):
        if n == 0:
            assert torch.equal(state["S"][row], initial["S"][row])
            continue
        ref_o, ref_state = naive_dplr(*(y[row : row + 1, :, :n] for y in x), initial_state={"S": initial["S"][row : row + 1]})
        check(o[row : row + 1, :, :n], {"S": state["S"][row : row + 1]}, ref_o, ref_state, torch.float64)
    with pytest.raises(ValueError, match="lengths"):
        recurrent_dplr(*x, lengths=lengths)


def test_bad_shapes_are_refused_by_name():
    q, k, v, a, b, w = make_inputs(5, "rwkv7", "rwkv7", seed=1)
    for name, args in (("a", (q, k, v, a[..., :3], b, w)), ("b", (q, k, v, a, b[:, :1], w)), ("w", (q, k, v, a, b, w[..., 0])),
                       ("k", (q, k[..., :3], v, a, b, w)), ("q", (q, k, v[:, :, :2], a, b, w))):
        with pytest.raises(ValueError, match=name):
            chunk_dplr(*args)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_dplr(q, k, v, a, b, w, initial_state={"S": torch.zeros(B, H, V, K, dtype=torch.float64)})


def test_state_layout():
    assert dplr_state_layout(n_heads=H, key_dim=K, value_dim=V) == {"S": (("batch", H, K, V), "float32", 0.0)}
    assert set(DPLR_FORMS) == {"naive", "chunk", "recurrent", "step"} and DEFAULT_CHUNK == 16


# ---- fla's own pure-PyTorch reference (flash-linear-attention; the file needs only torch and einops) ----


@pytest.mark.parametrize("kind", KINDS)
def test_fla_dplr_recurrence(kind):
    """fla's dplr_recurrence (alpha = a, beta = b, gk = w; [B, H, T, D], q scaled by K^-0.5, computed in float32,
    state [B, H, K, V]) pins the convention: a reads the state before the decay, the state is key-major."""
    fla = fla_naive("ops/generalized_delta_rule/dplr/naive.py")
    x, initial, _, _ = reference(C + 1, kind, "rwkv7")
    x, S0 = tuple(y.float().double() for y in x), initial["S"].float().double()  # values fla holds exactly
    ref_o, ref_S = fla.dplr_recurrence(*(y.float() for y in x), initial_state=S0.float())
    o, state = naive_dplr(*x, initial_state={"S": S0}, scale=K**-0.5)
    assert rel_err(ref_o, o) <= TOLERANCE[torch.float32] and rel_err(ref_S, state["S"]) <= TOLERANCE[torch.float32]


# ---- the chunk and step forms as ONNX graphs in ONNX Runtime ----

# The prefill graph's scan across chunks, bounded to 2^4 chunks (a sequence_bound of C * 16 tokens) for the
# export's sake (each level adds ~1 s to torch.export); tests/ops/test_delta.py runs the scan's full 16 levels.
GRAPH_LEVELS = 4
NO_LOOPS = {"Loop", "Scan", "If", "SequenceMap"}
NAMES = {
    "prefill": (["q", "k", "v", "a", "b", "w", "S", "lengths"], ["o", "S_out", "o_ragged", "S_ragged"]),
    "decode": (["q", "k", "v", "a", "b", "w", "S"], ["o", "S_out"]),
}


class Prefill(torch.nn.Module):
    """The chunk form as it is (o, S_out) and with right-padded rows of ``lengths`` tokens (o_ragged, S_ragged)."""

    def forward(self, q, k, v, a, b, w, S, lengths):
        o, state = chunk_dplr(q, k, v, a, b, w, initial_state={"S": S}, chunk_size=C)
        o_ragged, ragged = chunk_dplr(q, k, v, a, b, w, initial_state={"S": S}, chunk_size=C, lengths=lengths)
        return o, state["S"], o_ragged, ragged["S"]


class Decode(torch.nn.Module):
    def forward(self, q, k, v, a, b, w, S):
        o, state = dplr_step(q, k, v, a, b, w, initial_state={"S": S})
        return o, state["S"]


def graph_inputs(T: int, seed: int, role: str = "decode"):
    """The graph's inputs, float32; the prefill graph's lengths are T and T - 1 (at least 0)."""
    x = make_inputs(T, "rwkv7", "strong", seed=seed)
    S = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    lengths = (torch.tensor([T, max(T - 1, 0)]),) if role == "prefill" else ()
    return tuple(t.float() for t in (*x, S)) + lengths


@pytest.fixture(scope="module")
def graphs(export_cache):
    """{role: (onnxruntime session, onnx model)}, exported once per run (shared by the xdist workers)."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    import onnx

    out = export_cache.get("dplr-graphs", {"levels": GRAPH_LEVELS, "C": C}, _export_graphs)
    paths = {role: str(out / f"{role}.onnx") for role in ("prefill", "decode")}
    session = lambda path: ort.InferenceSession(path, providers=["CPUExecutionProvider"])  # noqa: E731
    return {role: (session(path), onnx.load(path)) for role, path in paths.items()}


def _export_graphs(out):
    from edgelin.exporters.exporter import export_graph

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out.mkdir()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    seq = torch.export.Dim("sequence", min=1, max=1 << 24)
    for role, module, T in (("prefill", Prefill(), 2 * C + 3), ("decode", Decode(), 1)):
        dims = {0: batch} if role == "decode" else {0: batch, 2: seq}
        dynamic = (dims,) * 6 + ({0: batch},) * (len(NAMES[role][0]) - 6)
        with delta.sequence_bound(C << GRAPH_LEVELS):  # as `edgelin export --max-sequence` bounds it
            export_graph(module.eval(), graph_inputs(T, 0, role), NAMES[role], dynamic, 20, out / f"{role}.onnx")


def run_graph(graphs, role, inputs):
    return graphs[role][0].run(None, dict(zip(NAMES[role][0], (x.numpy() for x in inputs))))


def test_graphs_have_no_loops(graphs):
    for role, (_, proto) in graphs.items():
        ops = {n.op_type for n in proto.graph.node}
        assert not ops & NO_LOOPS, f"{role}: {sorted(ops & NO_LOOPS)}"
        dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
        assert dims == (["batch", H, 1, K] if role == "decode" else ["batch", H, "sequence", K]), dims


@pytest.mark.parametrize("T", [1, C - 1, C, C + 1, C * (1 << GRAPH_LEVELS)], ids=lambda t: f"T{t}")
def test_prefill_graph_matches_torch(graphs, T):
    """ONNX Runtime's prefill graph against the PyTorch chunk form (float32) and the float64 naive form; with
    lengths T and T - 1, the second row's outputs at its real tokens and its state are those of its tokens alone."""
    x = graph_inputs(T, seed=T, role="prefill")
    got = [torch.from_numpy(y) for y in run_graph(graphs, "prefill", x)]
    with torch.no_grad():
        refs = Prefill()(*x)
    x64 = [y.double() for y in x[:7]]
    exact_o, exact = naive_dplr(*x64[:6], initial_state={"S": x64[6]})
    short = T - 1  # the second row's real tokens
    if short:
        short_o, short_S = naive_dplr(*(y[1:, :, :short] for y in x64[:6]), initial_state={"S": x64[6][1:]})
    else:
        short_o, short_S = exact_o[1:, :, :0], {"S": x64[6][1:]}
    truths = (
        exact_o, exact["S"], torch.cat([exact_o[:1], F.pad(short_o, (0, 0, 0, 1))], 0), torch.cat([exact["S"][:1], short_S["S"]])
    )
    keep = torch.ones(B, 1, T, 1, dtype=torch.bool)
    keep[1, :, short:] = False  # the second row's padded position: its output means nothing
    for name, g, ref, true in zip(NAMES["prefill"][1], got, refs, truths):
        assert g.shape == ref.shape, name
        if name == "o_ragged":
            g, ref, true = (torch.where(keep, y, 0.0) for y in (g, ref, true))
        assert rel_err(g, ref) <= 1e-6, f"{name}: {rel_err(g, ref):.2e} vs torch"
        assert rel_err(g, true) <= TOLERANCE[torch.float32], f"{name}: {rel_err(g, true):.2e} vs float64 naive"


def test_prefill_graph_beyond_its_scan_is_nan(graphs):
    """More chunks than the graph's scan holds (2^levels) give NaN, not a wrong state."""
    got = run_graph(graphs, "prefill", graph_inputs(C * (1 << GRAPH_LEVELS) + 1, seed=3, role="prefill"))
    assert all(np.isnan(y).all() for y in got)


def test_decode_graph_matches_torch(graphs):
    """20 decode steps through the graph, each state fed back, against dplr_step in PyTorch and the float64
    naive form over the 20 tokens; batch 2."""
    x = graph_inputs(20, 5)
    S, ref = x[6].numpy(), {"S": x[6]}
    outs = []
    for t in range(20):
        one = [y[:, :, t : t + 1] for y in x[:6]]
        o, S = run_graph(graphs, "decode", (*one, torch.from_numpy(S)))
        with torch.no_grad():
            r, ref = dplr_step(*one, initial_state=ref)
        assert rel_err(torch.from_numpy(o), r) <= 1e-6 and rel_err(torch.from_numpy(S), ref["S"]) <= 1e-6, t
        outs.append(torch.from_numpy(o))
    exact_o, exact = naive_dplr(*(y.double() for y in x[:6]), initial_state={"S": x[6].double()})
    assert rel_err(torch.cat(outs, dim=2), exact_o) <= TOLERANCE[torch.float32]
    assert rel_err(torch.from_numpy(S), exact["S"]) <= TOLERANCE[torch.float32]
