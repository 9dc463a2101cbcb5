"""The delta rule with a per-channel decay (Kimi Delta Attention) and the delta product (Gated DeltaProduct): every
fast form against its naive float64 loop, fla's own pure-PyTorch references, and the fused node's per-channel rule
in ONNX Runtime.

Inputs: q, k unit vectors, v Gaussian, batch 2, H = 2, K = 8, V = 12 (K != V catches a transposed state), chunk
C = 16, every sequence from a carried state (7 tokens through the naive form). The per-channel gate g [B, H, T, K]
is logsigmoid of a spread with ~10 % of the entries at -30 (forget that channel at once) and ~20 % at ~0 (keep it),
so each chunk sees both extremes per channel; beta uniform in (0, 1), or in (1, 2) (negative eigenvalues).

Tolerances (relative error max|fast - naive| / max|naive|): float64 1e-12, float32 5e-6, as tests/ops/test_delta.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from edgelin.ops import fused
from edgelin.ops.delta import (
    DELTA_FORMS,
    DELTA_PRODUCT_FORMS,
    chunk_delta_product,
    chunk_delta_rule,
    delta_product_step,
    delta_step,
    l2norm,
    naive_delta_product,
    naive_delta_rule,
)
from testkit.delta import check, rel_err

B, H, K, V, C = 2, 2, 8, 12, 16
PREFIX = 7
LENGTHS = (1, C - 1, C, C + 1, 1000)


def channel_gate(shape, gen) -> torch.Tensor:
    """A log-decay per channel: logsigmoid of a spread, ~10 % of the entries -30, ~20 % -1e-6."""
    g = F.logsigmoid(torch.randn(*shape, generator=gen, dtype=torch.float64) * 2 + 1)
    r = torch.rand(*shape, generator=gen, dtype=torch.float64)
    return torch.where(r < 0.1, -30.0, torch.where(r > 0.8, -1e-6, g))


def make_inputs(T: int, seed: int, *, n: int = 0, neg: bool = False, batch: int = B):
    """q, k (unit), v, beta, g in float64: n = 0 the per-channel delta rule (k [B, H, T, K], g [B, H, T, K]);
    n >= 1 the delta product (k [B, H, T, n, K], v [B, H, T, n, V], beta [B, H, T, n], g per head [B, H, T])."""
    gen = torch.Generator().manual_seed(seed)
    steps = (n,) if n else ()
    q = l2norm(torch.randn(batch, H, T, K, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(batch, H, T, *steps, K, generator=gen, dtype=torch.float64))
    v = torch.randn(batch, H, T, *steps, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, H, T, *steps, generator=gen, dtype=torch.float64) + (1.0 if neg else 0.0)
    g = channel_gate((batch, H, T, K) if not n else (batch, H, T), gen)
    return q, k, v, beta, g


@functools.lru_cache(maxsize=None)
def reference(T: int, n: int = 0, neg: bool = False):
    """(inputs, initial state, o, final state) of the naive form, float64, from a carried state. Do not mutate."""
    naive = naive_delta_product if n else naive_delta_rule
    p = make_inputs(PREFIX, seed=1, n=n, neg=neg)
    _, initial = naive(*p[:4], g=p[4])
    x = make_inputs(T, seed=100 + T, n=n, neg=neg)
    o, final = naive(*x[:4], g=x[4], initial_state=initial)
    return x, initial, o, final


def run(forms, form, x, initial, dtype, **kw):
    q, k, v, beta, g = (t.to(dtype) for t in x)
    return forms[form](q, k, v, beta, g=g, initial_state={"S": initial["S"].to(dtype)}, chunk_size=C, **kw)


# ---- the per-channel decay --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("neg", [False, True], ids=["beta01", "beta12"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_channel_decay_matches_naive(form, neg, T, dtype):
    x, initial, ref_o, ref_state = reference(T, neg=neg)
    check(*run(DELTA_FORMS, form, x, initial, dtype), ref_o, ref_state, dtype)


@pytest.mark.parametrize("chunk_size", [1, 5, 32, 64])
def test_channel_decay_any_chunk_size(chunk_size):
    x, initial, ref_o, ref_state = reference(C + 1)
    o, state = chunk_delta_rule(*x[:4], g=x[4], initial_state=initial, chunk_size=chunk_size)
    check(o, state, ref_o, ref_state, torch.float64)


def test_channel_decay_orders_decay_before_the_update():
    """The naive loop is fla's order, S_t = (I - beta k k^T) diag(e^g) S + beta k v^T, written out for one step;
    a per-channel g equal on every channel is the per-head gate."""
    x, initial, _, _ = reference(3)
    q, k, v, beta, g = x
    S = initial["S"]
    decayed = g[:, :, 0, :, None].exp() * S  # [B, H, K, V]: rows scaled
    k0 = k[:, :, 0]
    S1 = decayed + beta[:, :, 0, None, None] * k0[..., :, None] * (v[:, :, 0, None, :] - k0[..., None, :] @ decayed)
    _, state = naive_delta_rule(q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], g=g[:, :, :1], initial_state=initial)
    assert rel_err(state["S"], S1) <= 1e-14
    per_head = g[..., 0]  # [B, H, T]
    for form in ("naive", "chunk"):
        ref = DELTA_FORMS[form](q, k, v, beta, g=per_head, initial_state=initial, chunk_size=C)
        got = DELTA_FORMS[form](q, k, v, beta, g=per_head[..., None].expand(-1, -1, -1, K), initial_state=initial, chunk_size=C)
        check(*got, *ref, torch.float64)


def test_channel_decay_step_is_one_token():
    x, initial, _, _ = reference(C + 1)
    q, k, v, beta, g = x
    q, k, v, beta, g = (t[:, :, :1] for t in (q, k, v, beta, g))
    ref_o, ref_state = naive_delta_rule(q, k, v, beta, g=g, initial_state=initial)
    o, state = delta_step(q, k, v, beta, g=g, initial_state=initial)
    assert o.shape == (B, H, 1, V)
    check(o, state, ref_o, ref_state, torch.float64)


def test_channel_decay_strong_gates_stay_finite():
    """Every channel at -30 per step for whole chunks (exp(-30 C) underflows to 0): no NaN or inf in float32, and
    the float64 result is the naive one."""
    q, k, v, beta, g = make_inputs(3 * C + 5, seed=5)
    g = torch.where(torch.arange(3 * C + 5)[None, None, :, None] < 2 * C, -30.0, g)  # [B, H, T, K]
    ref_o, ref_state = naive_delta_rule(q, k, v, beta, g=g)
    check(*chunk_delta_rule(q, k, v, beta, g=g, chunk_size=C), ref_o, ref_state, torch.float64)
    o, state = chunk_delta_rule(q.float(), k.float(), v.float(), beta.float(), g=g.float(), chunk_size=C)
    check(o, state, ref_o, ref_state, torch.float32)


@pytest.mark.parametrize("form", ["naive", "chunk"])
def test_channel_decay_ragged_rows(form):
    """lengths: each row's final state is that of its own tokens (the padding forgets nothing per channel)."""
    q, k, v, beta, g = make_inputs(2 * C + 3, seed=7)
    lengths = torch.tensor([2 * C + 3, C - 2])
    o, state = DELTA_FORMS[form](q, k, v, beta, g=g, chunk_size=C, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        one = slice(b, b + 1)
        ref_o, ref_state = naive_delta_rule(q[one, :, :n], k[one, :, :n], v[one, :, :n], beta[one, :, :n], g=g[one, :, :n])
        check(o[one, :, :n], {"S": state["S"][one]}, ref_o, ref_state, torch.float64)


def test_fla_kda_recurrence():
    """fla's own naive KDA loop (ops/kda/naive.py: [B, T, H, .], float32 inside) gives the naive form's result."""
    naive = pytest.importorskip("fla.ops.kda.naive", reason="flash-linear-attention (with triton) is not importable")
    x, initial, ref_o, ref_state = reference(2 * C + 3)
    q, k, v, beta, g = (t.transpose(1, 2).float() for t in x)  # [B, T, H, ...]
    o, S = naive.naive_recurrent_kda(q, k, v, g, beta, scale=1.0, initial_state=initial["S"].float(), output_final_state=True)
    check(o.transpose(1, 2), {"S": S}, ref_o, ref_state, torch.float32)


def test_channel_decay_fused_matches_naive():
    """Under the fused lowering the chunk and step forms run the node's recurrence (per-channel gated_delta)."""
    x, initial, ref_o, ref_state = reference(C + 3)
    with fused.lowering("fused"):
        check(*run(DELTA_FORMS, "chunk", x, initial, torch.float64), ref_o, ref_state, torch.float64)


def test_onnx_runtime_runs_the_per_channel_gated_delta_rule():
    """ONNX Runtime's LinearAttention, update_rule gated_delta with the decay [B, T, H K], computes KDA's order
    (decay, then the delta update): the same as the naive form in float32."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    x, initial, ref_o, ref_state = reference(C + 3)
    q, k, v, beta, g = (t.float() for t in x)
    T = q.shape[2]
    names = ("query", "key", "value", "past_state", "decay", "beta")
    node = helper.make_node("LinearAttention", list(names), ["output", "present_state"], domain="com.microsoft",
                            update_rule="gated_delta", q_num_heads=H, kv_num_heads=H, scale=1.0)
    graph = helper.make_graph(
        [node], "kda", [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in names],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("output", "present_state")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    packed = lambda t: t.transpose(1, 2).reshape(B, T, -1).numpy()  # noqa: E731  [B, H, T, D] -> [B, T, H D]
    feeds = {"query": packed(q), "key": packed(k), "value": packed(v), "past_state": initial["S"].float().numpy(),
             "decay": packed(g), "beta": beta.transpose(1, 2).contiguous().numpy()}
    o, S = session.run(None, feeds)
    o = torch.from_numpy(o).view(B, T, H, V).transpose(1, 2)
    check(o, {"S": torch.from_numpy(S)}, ref_o, ref_state, torch.float32)


# ---- the delta product ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_delta_product_matches_naive(form, n, T, dtype):
    x, initial, ref_o, ref_state = reference(T, n=n, neg=True)
    check(*run(DELTA_PRODUCT_FORMS, form, x, initial, dtype), ref_o, ref_state, dtype)


def test_delta_product_without_gate_and_one_step_is_the_delta_rule():
    """n = 1 is the gated delta rule; g=None takes no decay."""
    x, initial, _, _ = reference(C + 1, n=1)
    q, k, v, beta, g = x
    for gate in (g, None):
        ref = naive_delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], g=gate, initial_state=initial)
        for form in ("naive", "chunk"):
            check(*DELTA_PRODUCT_FORMS[form](q, k, v, beta, g=gate, initial_state=initial, chunk_size=C), *ref, torch.float64)


def test_delta_product_step_is_one_token():
    x, initial, _, _ = reference(C + 1, n=2)
    q, k, v, beta, g = (t[:, :, :1] for t in x)
    o, state = delta_product_step(q, k, v, beta, g=g, initial_state=initial)
    assert o.shape == (B, H, 1, V)
    check(o, state, *naive_delta_product(q, k, v, beta, g=g, initial_state=initial), torch.float64)


def test_delta_product_fused_matches_naive():
    x, initial, ref_o, ref_state = reference(C + 3, n=2)
    with fused.lowering("fused"):
        check(*run(DELTA_PRODUCT_FORMS, "chunk", x, initial, torch.float64), ref_o, ref_state, torch.float64)
        q, k, v, beta, g = (t[:, :, :1] for t in x)
        o, state = delta_product_step(q, k, v, beta, g=g, initial_state=initial)
    check(o, state, *naive_delta_product(q, k, v, beta, g=g, initial_state=initial), torch.float64)


def test_fla_gated_delta_product_recurrence():
    """fla's naive Gated DeltaProduct loop (ops/gated_delta_product/naive.py: steps interleaved along T, float32
    inside) gives the naive form's result."""
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive", reason="flash-linear-attention (triton) is not importable")
    n = 3
    x, initial, ref_o, ref_state = reference(C + 3, n=n, neg=True)
    q, k, v, beta, g = x
    T = q.shape[2]
    steps = lambda t: t.permute(0, 2, 3, 1, *range(4, t.dim())).reshape(B, T * n, H, *t.shape[4:]).float()  # noqa: E731
    o, S = naive.naive_recurrent_gated_delta_product(
        q.transpose(1, 2).float(), steps(k), steps(v), g.transpose(1, 2).float(), steps(beta), 1.0,
        initial_state=initial["S"].float(), output_final_state=True, num_householder=n,
    )
    check(o.transpose(1, 2), {"S": S}, ref_o, ref_state, torch.float32)


def test_bad_shapes_are_refused():
    x, initial, _, _ = reference(3, n=2)
    q, k, v, beta, g = x
    with pytest.raises(ValueError, match=r"beta must be .*\[B, H, T, n\]"):
        chunk_delta_product(q, k, v, beta[..., 0], g=g)
    with pytest.raises(ValueError, match=r"g \(log-decay\) must be .*\[B, H, T\]"):
        chunk_delta_product(q, k, v, beta, g=g[..., None].expand(-1, -1, -1, K))
    with pytest.raises(ValueError, match=r"per key channel"):
        chunk_delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], g=g[..., None].expand(-1, -1, -1, K + 1))
