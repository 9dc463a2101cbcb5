"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet): every fast form against the naive
float64 reference, the chunk form's pieces on their own, fla's pure-PyTorch references, and the chunk and
step forms exported to ONNX and run in ONNX Runtime.

Inputs: q, k unit vectors, v Gaussian, batch 2, H = 2, K = 8, V = 12 (K != V catches a transposed state),
chunk C = 16; beta in four regimes (near 0, uniform in (0, 1), near 1, in (1, 2): negative eigenvalues); the
gate g = logsigmoid of a spread with ~10 % of the steps at -20 (forget) and ~20 % at ~0 (keep), so a chunk
sees both extremes. Every sequence starts from a carried state (7 tokens through the naive form).

Tolerances (relative error max|fast - naive| / max|naive| per tensor): float64 1e-12; float32 5e-6, ~10x the
worst measured at these sizes (4.6e-7; scripts/delta_accuracy.py prints the table, docs/DESIGN.md quotes
it for K = 64 and 128).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import edgelin.ops.delta as delta
from edgelin.ops import (
    DELTA_FORMS,
    chunk_delta_rule,
    chunk_states,
    delta_step,
    l2norm,
    naive_delta_rule,
    recurrent_delta_rule,
    unit_lower_inverse,
)
from testkit.delta import (
    B, BETAS, C, H, K, LENGTHS, PREFIX, RULES, TOLERANCE, V, check, fla_naive, make_inputs, reference, rel_err,
)


def cast(x, dtype):
    return None if x is None else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("betas", BETAS)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_fast_form_matches_naive(form, rule, betas, T, dtype):
    (q, k, v, beta, g), initial, ref_o, ref_state = reference(T, rule, betas)
    o, state = DELTA_FORMS[form](
        cast(q, dtype), cast(k, dtype), cast(v, dtype), cast(beta, dtype), g=cast(g, dtype),
        initial_state={"S": initial["S"].to(dtype)}, chunk_size=C,
    )
    check(o, state, ref_o, ref_state, dtype)


@pytest.mark.parametrize("rule", RULES)
def test_fresh_state(rule):
    """No initial_state is a zero state, in every form."""
    q, k, v, beta, g = make_inputs(2 * C + 3, rule, "uniform", seed=3)
    ref_o, ref_state = naive_delta_rule(q, k, v, beta, g=g, initial_state={"S": torch.zeros(B, H, K, V, dtype=torch.float64)})
    for form in ("naive", "chunk", "recurrent"):
        check(*DELTA_FORMS[form](q, k, v, beta, g=g, chunk_size=C), ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("rule", RULES)
def test_step_is_one_token(rule):
    """delta_step from a carried state is the naive form's first token, keeping the token axis."""
    (q, k, v, beta, g), initial, _, _ = reference(C + 1, rule, "neg")
    one = slice(0, 1)
    ref_o, ref_state = naive_delta_rule(q[:, :, one], k[:, :, one], v[:, :, one], beta[:, :, one], g=None if g is None else g[:, :, one], initial_state=initial)
    o, state = delta_step(q[:, :, one], k[:, :, one], v[:, :, one], beta[:, :, one], g=None if g is None else g[:, :, one], initial_state=initial)
    assert o.shape == (B, H, 1, V)
    check(o, state, ref_o, ref_state, torch.float64)
    with pytest.raises(ValueError, match="one token"):
        delta_step(q[:, :, :2], k[:, :, :2], v[:, :, :2], beta[:, :, :2])


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("rule", RULES)
def test_chunk_any_chunk_size(rule, chunk_size):
    """T = 53 against chunk sizes 1, 5 (not a power of two: the inverse is padded), 37 and 64 (longer than T)."""
    x = make_inputs(3 * C + 5, rule, "near1", seed=7)
    _, initial = naive_delta_rule(*make_inputs(PREFIX, rule, "near1", seed=8)[:4])
    ref_o, ref_state = naive_delta_rule(*x[:4], g=x[4], initial_state=initial)
    check(*chunk_delta_rule(*x[:4], g=x[4], initial_state=initial, chunk_size=chunk_size), ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("rule", RULES)
def test_chunk_state_carried_across_calls(rule):
    """chunk(a) then chunk(b, its state) == chunk(a + b); the cut falls inside a chunk."""
    q, k, v, beta, g = make_inputs(3 * C + 5, rule, "uniform", seed=11)
    o, state = chunk_delta_rule(q, k, v, beta, g=g, chunk_size=C)
    cut = C + 5
    part = lambda x, s: None if x is None else x[:, :, s]  # noqa: E731
    first, rest = slice(0, cut), slice(cut, None)
    o1, s1 = chunk_delta_rule(*(part(x, first) for x in (q, k, v, beta)), g=part(g, first), chunk_size=C)
    o2, s2 = chunk_delta_rule(*(part(x, rest) for x in (q, k, v, beta)), g=part(g, rest), initial_state=s1, chunk_size=C)
    check(torch.cat([o1, o2], dim=2), s2, o, state, torch.float64)


def test_repeated_keys_reflection():
    """The hard case for the chunk's inverse: one key repeated with beta = 2 (a reflection, eigenvalue -1,
    nothing decays) and beta = 1. The product (I - M)(I + M^2)(I + M^4)... is off by 1e2..1e12 here in
    float64 (its factors hold powers of M); block forward substitution stays within the contract."""
    gen = torch.Generator().manual_seed(5)
    T = 200
    k = l2norm(torch.randn(B, H, 1, K, generator=gen, dtype=torch.float64)).expand(B, H, T, K).clone()
    k[:, :, ::7] = l2norm(torch.randn(B, H, len(range(0, T, 7)), K, generator=gen, dtype=torch.float64))
    q = l2norm(torch.randn(B, H, T, K, generator=gen, dtype=torch.float64))
    v = torch.randn(B, H, T, V, generator=gen, dtype=torch.float64)
    for b in (1.0, 2.0):
        beta = torch.full((B, H, T), b, dtype=torch.float64)
        check(*chunk_delta_rule(q, k, v, beta, chunk_size=64), *naive_delta_rule(q, k, v, beta), torch.float64)


@pytest.mark.parametrize("size", [1, 2, 5, 16, 37, 64], ids=lambda c: f"C{c}")
def test_unit_lower_inverse(size):
    """(I + M)^-1 for strictly lower M against a triangular solve, on the chunk's own kind of M (beta k k^T
    with correlated keys, beta up to 2) and on a random one."""
    gen = torch.Generator().manual_seed(size)
    keys = l2norm(torch.randn(3, size, 2, generator=gen, dtype=torch.float64))  # 2-D keys: strongly correlated
    beta = 2 * torch.rand(3, size, 1, generator=gen, dtype=torch.float64)
    for M in ((beta * keys @ keys.transpose(-1, -2)).tril(-1), torch.randn(3, size, size, generator=gen, dtype=torch.float64).tril(-1) / 2):
        eye = torch.eye(size, dtype=torch.float64).expand(3, size, size)
        ref = torch.linalg.solve_triangular(eye + M, eye, upper=False, unitriangular=True)
        assert rel_err(unit_lower_inverse(M), ref) <= 1e-12


def test_scan_levels():
    """The scan across chunks with more levels than needed (the exported graph's MAX_SCAN_LEVELS) gives the
    same states; with too few levels the result is NaN, never silently wrong."""
    gen = torch.Generator().manual_seed(2)
    n = 11
    A = 0.5 * torch.randn(B, H, n, K, K, generator=gen, dtype=torch.float64)
    Bm = torch.randn(B, H, n, K, V, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)
    S, starts = S0, []
    for i in range(n):  # the sequential definition
        starts.append(S)
        S = A[:, :, i] @ S + Bm[:, :, i]
    ref = torch.stack(starts, dim=2)
    assert delta.scan_levels(n) == 4 and delta.scan_levels(1) == 0 and delta.scan_levels(16) == 4
    for levels in (4, 5, delta.MAX_SCAN_LEVELS):
        got, final = chunk_states(A, Bm, S0, levels)
        assert rel_err(got, ref) <= 1e-13 and rel_err(final, S) <= 1e-13, levels
    got, final = chunk_states(A, Bm, S0, 3)  # 8 < 11 chunks
    assert torch.isnan(got).all() and torch.isnan(final).all()


class _Symbolic:
    """Stands for a chunk count unknown while a graph is traced (anything but an int)."""


@pytest.mark.parametrize("tokens, chunk, levels", [(4096, 64, 6), (1024, 64, 4), (1000, 64, 4), (1025, 64, 5), (64, 64, 0), (1, 64, 0),
                                                   (4096, 16, 8), (100, 7, 4)])
def test_a_sequence_bound_sets_the_levels_of_a_traced_scan(tokens, chunk, levels):
    """While an export traces (a symbolic chunk count), the scan gets just enough levels for the bound's tokens in
    chunks (2^levels chunks hold them; one level fewer would not), and the bound records that it was used;
    without a bound, MAX_SCAN_LEVELS. An int count is always exact."""
    n = -(-tokens // chunk)
    assert 2**levels >= n and (levels == 0 or 2 ** (levels - 1) < n)
    assert delta.scan_levels(_Symbolic(), chunk) == delta.MAX_SCAN_LEVELS
    with delta.sequence_bound(tokens) as bound:
        assert not bound.used and delta.scan_levels(5, chunk) == 3 and not bound.used
        assert delta.scan_levels(_Symbolic(), chunk) == levels and bound.used
    assert delta.scan_levels(_Symbolic(), chunk) == delta.MAX_SCAN_LEVELS  # the bound ends with its block


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("form", ["naive", "chunk"])
def test_lengths_ragged(form, rule):
    """Right-padded rows of different lengths: each row's output (at its real tokens) and state are those of
    the row alone; a length of 0 keeps the state."""
    T = 2 * C + 3
    q, k, v, beta, g = make_inputs(T, rule, "near1", seed=21, batch=3)
    _, initial = naive_delta_rule(*make_inputs(PREFIX, rule, "near1", seed=22, batch=3)[:4])
    lengths = torch.tensor([T, C + 1, 0])
    o, state = DELTA_FORMS[form](q, k, v, beta, g=g, initial_state=initial, chunk_size=C, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        row = lambda x: None if x is None else x[b : b + 1, :, :n]  # noqa: E731
        if n == 0:
            assert torch.equal(state["S"][b], initial["S"][b])
            continue
        ref_o, ref_state = naive_delta_rule(row(q), row(k), row(v), row(beta), g=row(g), initial_state={"S": initial["S"][b : b + 1]})
        check(o[b : b + 1, :, :n], {"S": state["S"][b : b + 1]}, ref_o, ref_state, torch.float64)
    with pytest.raises(ValueError, match="lengths"):
        recurrent_delta_rule(q, k, v, beta, g=g, lengths=lengths)


def test_qk_l2norm_option():
    """qk_l2norm=True is normalising q and k first (fla's x / sqrt(sum x^2 + 1e-6)); scale multiplies q."""
    gen = torch.Generator().manual_seed(4)
    q, k = (3 * torch.randn(B, H, C + 3, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, C + 3, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, C + 3, generator=gen, dtype=torch.float64)
    qn, kn = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    ref_o, ref_state = naive_delta_rule(qn * 0.25, kn, v, beta)
    for form in ("naive", "chunk", "recurrent"):
        check(*DELTA_FORMS[form](q, k, v, beta, qk_l2norm=True, scale=0.25, chunk_size=C), ref_o, ref_state, torch.float64)


@pytest.mark.parametrize("form", ["naive", "chunk", "recurrent"])
def test_zero_gate_is_deltanet(form):
    """g = 0 through the gated code gives DeltaNet's (g=None) result."""
    q, k, v, beta, _ = make_inputs(2 * C + 3, "delta", "uniform", seed=9)
    ref = DELTA_FORMS[form](q, k, v, beta, chunk_size=C)
    check(*DELTA_FORMS[form](q, k, v, beta, g=torch.zeros_like(beta), chunk_size=C), *ref, torch.float64)


def test_bad_shapes_are_refused_by_name():
    q, k, v, beta, g = make_inputs(5, "gated", "uniform", seed=1)
    with pytest.raises(ValueError, match="beta"):
        chunk_delta_rule(q, k, v, beta[:, :1])
    with pytest.raises(ValueError, match="g"):
        chunk_delta_rule(q, k, v, beta, g=g[..., None])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_delta_rule(q, k, v, beta, initial_state={"S": torch.zeros(B, H, V, K, dtype=torch.float64)})
    with pytest.raises(ValueError, match="q, k"):
        chunk_delta_rule(q, k[..., :3], v, beta)


# ---- fla's own pure-PyTorch references (flash-linear-attention; files need only torch and einops) ----


@pytest.mark.parametrize("betas", ["uniform", "neg"])
def test_fla_delta_rule_recurrence(betas):
    """fla's delta_rule_recurrence ([B, H, T, D], q scaled by K^-0.5, computed in float32, state [B, H, K, V])."""
    fla = fla_naive("ops/delta_rule/naive.py")
    (q, k, v, beta, _), initial, _, _ = reference(C + 1, "delta", betas)
    q, k, v, beta, S0 = (x.float().double() for x in (q, k, v, beta, initial["S"]))  # values fla can hold exactly
    ref_o, ref_S = fla.delta_rule_recurrence(q.float(), k.float(), v.float(), beta.float(), initial_state=S0.float())
    o, state = naive_delta_rule(q, k, v, beta, initial_state={"S": S0}, scale=K**-0.5)
    assert rel_err(ref_o, o) <= TOLERANCE[torch.float32] and rel_err(ref_S, state["S"]) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("betas", ["uniform", "neg"])
def test_fla_gated_delta_rule_recurrence(betas):
    """fla's naive_recurrent_gated_delta_rule ([B, T, H, D], default scale K^-0.5, float32, state [B, H, K, V])."""
    fla = fla_naive("ops/gated_delta_rule/naive.py")
    (q, k, v, beta, g), initial, _, _ = reference(C + 1, "gated", betas)
    q, k, v, beta, g, S0 = (x.float().double() for x in (q, k, v, beta, g, initial["S"]))
    t = lambda x: x.float().transpose(1, 2)  # noqa: E731  [B, H, T, ...] -> [B, T, H, ...]
    ref_o, ref_S = fla.naive_recurrent_gated_delta_rule(
        t(q), t(k), t(v), t(beta), t(g), initial_state=S0.float(), output_final_state=True
    )
    o, state = naive_delta_rule(q, k, v, beta, g=g, initial_state={"S": S0}, scale=K**-0.5)
    assert rel_err(ref_o.transpose(1, 2), o) <= TOLERANCE[torch.float32]
    assert rel_err(ref_S, state["S"]) <= TOLERANCE[torch.float32]


# ---- the chunk and step forms as ONNX graphs in ONNX Runtime ----
# One prefill export (the gated chunk form, dynamic batch and length; DeltaNet runs through it as g = 0, which
# test_zero_gate_is_deltanet shows is g=None's result) and one decode export holding both rules' steps.

# The prefill graph's scan across chunks, bounded to 2^4 chunks (a sequence_bound of C * 16 tokens) for the
# export's sake: each level adds ~1 s to torch.export here and the graph's structure is the same at every level;
# test_scan_levels runs the full 16 levels in PyTorch.
GRAPH_LEVELS = 4
NO_LOOPS = {"Loop", "Scan", "If", "SequenceMap"}
NAMES = {
    "prefill": (["q", "k", "v", "beta", "g", "S"], ["o", "S_out"]),
    "decode": (["q", "k", "v", "beta", "g", "S", "S_delta"], ["o", "S_out", "o_delta", "S_delta_out"]),
}


class Prefill(torch.nn.Module):
    def forward(self, q, k, v, beta, g, S):
        o, state = chunk_delta_rule(q, k, v, beta, g=g, initial_state={"S": S}, chunk_size=C)
        return o, state["S"]


class Decode(torch.nn.Module):
    """Gated DeltaNet's step from S, DeltaNet's (g=None) from S_delta."""

    def forward(self, q, k, v, beta, g, S, S_delta):
        o, state = delta_step(q, k, v, beta, g=g, initial_state={"S": S})
        o_delta, state_delta = delta_step(q, k, v, beta, initial_state={"S": S_delta})
        return o, state["S"], o_delta, state_delta["S"]


def graph_inputs(T: int, seed: int, role: str = "prefill"):
    x = make_inputs(T, "gated", "neg", seed=seed)
    S = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return tuple(t.float() for t in (*x, S) + ((S,) if role == "decode" else ()))


@pytest.fixture(scope="module")
def graphs(export_cache):
    """{role: (onnxruntime session, onnx model)}, exported once per run (shared by the xdist workers)."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    import onnx

    out = export_cache.get("delta-graphs", {"levels": GRAPH_LEVELS, "C": C}, _export_graphs)
    return {
        role: (ort.InferenceSession(str(out / f"{role}.onnx"), providers=["CPUExecutionProvider"]), onnx.load(str(out / f"{role}.onnx")))
        for role in ("prefill", "decode")
    }


def _export_graphs(out):
    from edgelin.exporters.exporter import export_graph

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out.mkdir()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    seq = torch.export.Dim("sequence", min=1, max=1 << 24)
    for role, module, T in (("prefill", Prefill(), 2 * C + 3), ("decode", Decode(), 1)):
        dims = {0: batch} if role == "decode" else {0: batch, 2: seq}
        dynamic = (dims,) * 5 + ({0: batch},) * (len(NAMES[role][0]) - 5)
        path = out / f"{role}.onnx"
        with delta.sequence_bound(C << GRAPH_LEVELS):  # as `edgelin export --max-sequence` bounds it
            export_graph(module.eval(), graph_inputs(T, 0, role), NAMES[role], dynamic, 20, path)


def run_graph(graphs, role, inputs):
    return graphs[role][0].run(None, dict(zip(NAMES[role][0], (x.numpy() for x in inputs))))


def test_graphs_have_no_loops(graphs):
    for role, (_, proto) in graphs.items():
        ops = {n.op_type for n in proto.graph.node}
        assert not ops & NO_LOOPS, f"{role}: {sorted(ops & NO_LOOPS)}"
        dims = [d.dim_param or d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
        assert dims == (["batch", H, 1, K] if role == "decode" else ["batch", H, "sequence", K]), dims


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [1, C - 1, C, C + 1, C * (1 << GRAPH_LEVELS)], ids=lambda t: f"T{t}")
def test_prefill_graph_matches_torch(graphs, T, rule):
    """ONNX Runtime's prefill graph against the PyTorch chunk form (float32) and the float64 naive form."""
    q, k, v, beta, g, S = graph_inputs(T, seed=T)
    if rule == "delta":
        g = torch.zeros_like(g)
    o, S_out = run_graph(graphs, "prefill", (q, k, v, beta, g, S))
    with torch.no_grad():
        ref_o, ref_S = Prefill()(q, k, v, beta, None if rule == "delta" else g, S)
        exact = naive_delta_rule(*(x.double() for x in (q, k, v, beta)), g=None if rule == "delta" else g.double(), initial_state={"S": S.double()})
    for name, got, ref, true in (("o", o, ref_o, exact[0]), ("S", S_out, ref_S, exact[1]["S"])):
        got = torch.from_numpy(got)
        assert got.shape == ref.shape, name
        assert rel_err(got, ref) <= 1e-6, f"{name}: {rel_err(got, ref):.2e} vs torch"
        assert rel_err(got, true) <= TOLERANCE[torch.float32], f"{name}: {rel_err(got, true):.2e} vs float64 naive"


def test_prefill_graph_beyond_its_scan_is_nan(graphs):
    """More chunks than the graph's scan holds (2^levels) give NaN, not a wrong state."""
    got = run_graph(graphs, "prefill", graph_inputs(C * (1 << GRAPH_LEVELS) + 1, seed=3))
    assert all(np.isnan(a).all() for a in got)


def test_decode_graph_matches_torch(graphs):
    """20 decode steps through the graph, each state fed back, against delta_step in PyTorch; batch 2."""
    q, k, v, beta, g, S, _ = graph_inputs(20, 5, "decode")
    S_gated = S_delta = S.numpy()
    ref_gated = ref_delta = {"S": S}
    for t in range(20):
        one = [x[:, :, t : t + 1] for x in (q, k, v, beta, g)]
        o_g, S_gated, o_d, S_delta = run_graph(graphs, "decode", (*one, torch.from_numpy(S_gated), torch.from_numpy(S_delta)))
        with torch.no_grad():
            r_g, ref_gated = delta_step(*one[:4], g=one[4], initial_state=ref_gated)
            r_d, ref_delta = delta_step(*one[:4], initial_state=ref_delta)
        for a, b in ((o_g, r_g), (S_gated, ref_gated["S"]), (o_d, r_d), (S_delta, ref_delta["S"])):
            assert rel_err(torch.from_numpy(a), b) <= 1e-6, t
