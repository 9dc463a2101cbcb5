"""Feature maps: the registry, performer's stabiliser and kernel estimate, cosFormer's position, and the
signed-denominator guard (stable_divide)."""

from __future__ import annotations

import math

import pytest
import torch

from edgelin.config import FEATURE_MAPS, ModelConfig
from edgelin.errors import ConfigError
from edgelin.layers.feature_maps import available, make_feature_map
from edgelin.ops import FORMS, stable_divide
from testkit import rel_err


F64_TOL = 1e-10  # relative error, float64
F32_TOL = 1e-5  # relative error, float32 (see tests/ops/test_forms.py)


def apply(fm, x: torch.Tensor, *, is_query: bool, start: int = 0) -> torch.Tensor:
    pos = None
    if fm.needs_position:
        B, _, T, _ = x.shape
        pos = start + torch.arange(T)[None, :].expand(B, T)  # [B, T]
    return fm(x, is_query=is_query, positions=pos)


# ---- registry ------------------------------------------------------------------------------------


def test_registry_holds_every_config_map():
    """LinearLM's maps are all in the registry; the registry also holds maps that only importers use."""
    assert set(FEATURE_MAPS) <= set(available())


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("head_dim, n_features", [(8, 0), (16, 24)], ids=["D8", "D16-m24"])
def test_every_map_builds_and_out_dim_is_its_width(name, head_dim, n_features):
    fm = make_feature_map(name, head_dim, n_features=n_features, seed=3, horizon=100)
    assert fm.name == name
    x = torch.randn(2, 3, 5, head_dim)
    for is_query in (True, False):
        y = apply(fm, x, is_query=is_query)
        assert y.shape == (2, 3, 5, fm.out_dim)
        assert torch.isfinite(y).all()
    if name in FEATURE_MAPS:
        cfg = ModelConfig(feature_map=name, head_dim=head_dim, n_features=n_features)
        assert cfg.feature_dim == fm.out_dim


@pytest.mark.parametrize("name", available())
def test_unsigned_maps_are_non_negative(name):
    """Maps that declare signed=False must never produce a negative feature (their denominator is >= 0)."""
    fm = make_feature_map(name, 8, horizon=16)  # cosformer: positions 17..39 pass its horizon, where cos < 0
    x = 10 * torch.randn(2, 2, 40, 8, dtype=torch.float64)
    y = torch.cat([apply(fm, x, is_query=True), apply(fm, x, is_query=False)])
    if fm.signed:
        assert (y < 0).any()
    else:
        assert (y >= 0).all()


@pytest.mark.parametrize("bad", ["softmax", "ELU+1", "", "elu"])
def test_unknown_name_is_a_value_error_listing_the_valid_ones(bad):
    with pytest.raises(ValueError) as info:
        make_feature_map(bad, 8)
    assert isinstance(info.value, ConfigError)
    message = str(info.value)
    assert repr(bad) in message
    for name in available():
        assert name in message


def test_cosformer_without_positions_is_refused():
    fm = make_feature_map("cosformer", 8)
    with pytest.raises(ValueError, match="position"):
        fm(torch.randn(1, 1, 3, 8), is_query=True)


# ---- performer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("normalize", [True, False], ids=["den", "noden"])
@pytest.mark.parametrize("norm", [30.0, 300.0], ids=["norm30", "norm300"])
def test_performer_large_norms_stay_finite(norm, normalize, dtype):
    """Without the stabiliser exp(w^T x) overflows at these norms (w^T x' reaches ~|w| |x| / D^(1/4) >> 88)."""
    D, T = 16, 40
    fm = make_feature_map("performer", D, n_features=32, seed=0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, D, generator=g, dtype=dtype) for _ in range(3))
    q = q / q.norm(dim=-1, keepdim=True) * norm
    k = k / k.norm(dim=-1, keepdim=True) * norm

    fq = fm(q, is_query=True)
    fk = fm(k, is_query=False)
    assert torch.isfinite(fq).all() and torch.isfinite(fk).all()
    assert torch.equal(fq.amax(dim=-1), torch.ones_like(fq[..., 0])), "the largest query feature is exactly 1"
    assert (fk <= math.exp(30.0)).all()

    o_chunk, s_chunk = FORMS["chunk"](q, k, v, feature_map=fm, chunk_size=16, normalize=normalize)
    o_rec, s_rec = FORMS["recurrent"](q, k, v, feature_map=fm, normalize=normalize)
    for t in [o_chunk, o_rec, *s_chunk.values(), *s_rec.values()]:
        assert torch.isfinite(t).all()
    tol = F64_TOL if dtype == torch.float64 else F32_TOL
    assert rel_err(o_chunk, o_rec) <= tol
    for key in s_rec:
        assert rel_err(s_chunk[key], s_rec[key]) <= tol, key


@pytest.mark.parametrize("norm", [0.1, 1.0, 5.0])
def test_performer_query_features_peak_at_exactly_one(norm):
    fm = make_feature_map("performer", 8, n_features=20, seed=1)
    x = torch.randn(3, 2, 7, 8)
    x = x / x.norm(dim=-1, keepdim=True) * norm
    assert torch.equal(fm(x, is_query=True).amax(-1), torch.ones(3, 2, 7))


@pytest.mark.parametrize("seed", [0, 1])
def test_performer_estimates_the_softmax_kernel(seed):
    """E[phi(q)^T phi(k)] = exp(q^T k / sqrt(D)), up to the positive per-query factor of the stabiliser.

    Statistical, with fixed seeds (deterministic). Inputs have norm 2, so q^T k / sqrt(D) spans about
    [-1, 1] and the kernel varies ~5x across pairs: a constant guess is ~20% off on average. FAVOR+'s
    relative standard deviation here is ~sqrt((e^|q'+k'|^2 - 1) / m) <~ 0.1 with m = 4096; measured
    mean relative errors are 0.02-0.03.
    """
    D, m, N = 16, 4096, 64
    fm = make_feature_map("performer", D, n_features=m, seed=seed).double()
    g = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(1, 1, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, N, D, generator=g, dtype=torch.float64)
    q, k = 2 * q / q.norm(dim=-1, keepdim=True), 2 * k / k.norm(dim=-1, keepdim=True)
    true = torch.exp(q[0, 0] @ k[0, 0].T / math.sqrt(D))  # [N, N]
    est = fm(q, is_query=True)[0, 0] @ fm(k, is_query=False)[0, 0].T  # [N, N], row i scaled by c_i > 0

    # 1) what attention uses: the weights over keys for each query (the per-query factor cancels)
    w_true = true / true.sum(-1, keepdim=True)
    w_est = est / est.sum(-1, keepdim=True)
    weight_err = ((w_est - w_true).abs() / w_true).mean().item()
    baseline = ((1.0 / N - w_true).abs() / w_true).mean().item()  # uniform attention
    assert weight_err < 0.06, f"mean relative error of attention weights {weight_err:.3f}"
    assert weight_err < 0.3 * baseline, f"{weight_err:.3f} is not much better than uniform ({baseline:.3f})"

    # 2) the kernel itself, undoing the stabiliser's per-query shift and key constant (see Performer's docstring)
    xq = q[0, 0] * D**-0.25
    wx = xq @ fm.projection.T  # [N, m]
    c = torch.exp(wx.amax(-1) - 0.5 * (xq * xq).sum(-1)) / math.sqrt(m) * math.exp(fm.key_shift)  # [N]
    kernel = est * c[:, None]
    kernel_err = ((kernel - true).abs() / true).mean().item()
    const_err = ((true.mean() - true).abs() / true).mean().item()
    corr = torch.corrcoef(torch.stack([kernel.flatten(), true.flatten()]))[0, 1].item()
    assert kernel_err < 0.06, f"mean relative error of the kernel {kernel_err:.3f}"
    assert kernel_err < 0.3 * const_err
    assert corr > 0.95, f"correlation {corr:.3f}"


def test_performer_projection_is_deterministic_per_seed():
    a = make_feature_map("performer", 16, n_features=40, seed=5)
    b = make_feature_map("performer", 16, n_features=40, seed=5)
    c = make_feature_map("performer", 16, n_features=40, seed=6)
    assert a.projection.shape == (40, 16)
    assert torch.equal(a.projection, b.projection)
    assert not torch.allclose(a.projection, c.projection)
    x = torch.randn(1, 2, 5, 16)
    assert torch.equal(a(x, is_query=False), b(x, is_query=False))
    assert "projection" in dict(a.named_buffers()), "the projection travels with the weights"


def test_performer_projection_blocks_are_orthogonal():
    """Rows within each block of D are mutually orthogonal (orthogonal random features)."""
    D, m = 8, 20  # two full blocks and a partial one
    w = make_feature_map("performer", D, n_features=m, seed=2).projection.double()
    for start in range(0, m, D):
        block = w[start : start + D]
        gram = block @ block.T
        off_diag = gram - torch.diag(torch.diagonal(gram))
        assert off_diag.abs().max() < 1e-5 * gram.diagonal().max()


# ---- cosFormer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["naive", "chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("normalize", [True, False], ids=["den", "noden"])
def test_cosformer_position_is_carried_in_the_state(form, normalize):
    fm = make_feature_map("cosformer", 8, horizon=16)  # short horizon: every position shift matters
    g = torch.Generator().manual_seed(4)
    B, T, cut = 3, 21, 9
    q, k, v = (torch.randn(B, 2, T, 8, generator=g, dtype=torch.float64) for _ in range(3))
    run = FORMS[form]
    o_all, s_all = run(q, k, v, feature_map=fm, chunk_size=4, normalize=normalize)
    o1, s1 = run(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], feature_map=fm, chunk_size=4, normalize=normalize)
    assert s1["pos"].tolist() == [cut] * B
    o2, s2 = run(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], feature_map=fm, initial_state=s1, chunk_size=4, normalize=normalize)
    assert s2["pos"].tolist() == [T] * B and s_all["pos"].tolist() == [T] * B
    assert s2["pos"].dtype == torch.int64
    assert rel_err(torch.cat([o1, o2], dim=2), o_all) <= F64_TOL
    for key in s_all:
        assert rel_err(s2[key], s_all[key]) <= F64_TOL, key

    # the check has teeth: the same state with the position reset gives a different continuation
    forgot = dict(s1, pos=torch.zeros_like(s1["pos"]))
    o_bad, _ = run(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], feature_map=fm, initial_state=forgot, chunk_size=4, normalize=normalize)
    assert rel_err(o_bad, o_all[:, :, cut:]) > 1e-3


def test_cosformer_positions_differ_per_sequence():
    """pos is per sequence: a batch whose rows have seen different numbers of tokens continues each correctly."""
    fm = make_feature_map("cosformer", 8, horizon=16)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    _, s_a = FORMS["naive"](q[:1, :, :3], k[:1, :, :3], v[:1, :, :3], feature_map=fm)
    _, s_b = FORMS["naive"](q[1:, :, :7], k[1:, :, :7], v[1:, :, :7], feature_map=fm)
    state = {n: torch.cat([s_a[n], s_b[n]]) for n in s_a}
    assert state["pos"].tolist() == [3, 7]
    o, s = FORMS["chunk"](q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], feature_map=fm, initial_state=state, chunk_size=4)
    o_a, _ = FORMS["naive"](q[:1, :, 7:], k[:1, :, 7:], v[:1, :, 7:], feature_map=fm, initial_state=s_a)
    o_b, _ = FORMS["naive"](q[1:, :, 7:], k[1:, :, 7:], v[1:, :, 7:], feature_map=fm, initial_state=s_b)
    assert s["pos"].tolist() == [8, 12]
    assert rel_err(o, torch.cat([o_a, o_b])) <= F64_TOL


# ---- signed maps: the denominator crossing zero --------------------------------------------------


def test_stable_divide_keeps_the_denominator_away_from_zero():
    eps = 1e-6
    den = torch.tensor([-1.0, -1e-3, -eps, -1e-9, -0.0, 0.0, 1e-9, eps, 1e-3, 1.0], dtype=torch.float64)
    num = torch.ones(den.shape[0], 3, dtype=torch.float64)
    out = stable_divide(num, den, eps)
    effective = 1.0 / out[:, 0]
    assert torch.isfinite(out).all()
    assert (effective.abs() >= eps * (1 - 1e-12)).all()
    assert (torch.sign(effective[den > 0]) > 0).all() and (torch.sign(effective[den < 0]) < 0).all()
    nonneg = den >= 0
    assert torch.equal(out[nonneg], num[nonneg] / (den[nonneg] + eps)[:, None]), "textbook for den >= 0"


@pytest.mark.parametrize("form", ["naive", "chunk", "recurrent", "parallel"])
def test_identity_with_denominator_is_finite_where_it_crosses_zero(form):
    """One key k = e1; queries q_t = (cos a_t, sin a_t) sweep the denominator q_t^T e1 through zero.

    The first query sits at den = -eps exactly, where a plain num / (den + eps) divides by zero.
    """
    eps = 1e-6
    fm = make_feature_map("identity", 2)
    T = 41
    angle = torch.linspace(0.0, math.pi, T - 1, dtype=torch.float64)
    q = torch.zeros(1, 1, T, 2, dtype=torch.float64)
    q[0, 0, 0] = torch.tensor([-eps, 0.0], dtype=torch.float64)
    q[0, 0, 1:, 0], q[0, 0, 1:, 1] = torch.cos(angle), torch.sin(angle)
    k = torch.zeros(1, 1, T, 2, dtype=torch.float64)
    k[0, 0, 0, 0] = 1.0  # only the first key is non-zero: z_t = e1 for every t
    v = torch.ones(1, 1, T, 2, dtype=torch.float64)
    o, state = FORMS[form](q, k, v, feature_map=fm, chunk_size=8, eps=eps, normalize=True)

    den = q[0, 0, :, 0]  # q_t^T z_t
    num = den[:, None] * v[0, 0]  # q_t^T S_t = den * v_0
    assert (den < 0).any() and (den > 0).any()
    assert torch.isfinite(o).all()
    assert (o[0, 0].abs() <= num.abs() / eps * (1 + 1e-9)).all(), "|o| <= |num| / eps"
    assert o[0, 0, 0].tolist() == pytest.approx([0.5, 0.5], rel=1e-12)  # -eps / (-eps - eps)
    assert torch.isinf(num[0] / (den[0] + eps)).all(), "the textbook division would have blown up"
    ref, _ = FORMS["naive"](q, k, v, feature_map=fm, eps=eps, normalize=True)
    assert rel_err(o, ref) <= F64_TOL
    assert torch.equal(state["z"], torch.tensor([[[1.0, 0.0]]], dtype=torch.float64))


def test_cosformer_past_its_horizon_divides_like_the_reference():
    """cosFormer's features turn negative past its horizon (cos a < 0), so phi(q)^T z can sit just below
    zero: the decode step must take eps with the denominator's sign, as the sequence forms do, not add it."""
    eps = 1e-6
    fm = make_feature_map("cosformer", 4, horizon=8)
    g = torch.Generator().manual_seed(0)
    q = torch.rand(1, 1, 1, 4, generator=g, dtype=torch.float64) + 0.1  # [B, H, 1, D]
    k = torch.zeros(1, 1, 1, 4, dtype=torch.float64)  # the token adds nothing: z stays as set below
    v = torch.randn(1, 1, 1, 3, generator=g, dtype=torch.float64)
    pos = torch.tensor([20])  # > horizon
    fq = fm(q, is_query=True, positions=pos[:, None])[:, :, 0]  # [B, H, F]
    assert (fq < 0).any()
    z = torch.rand(1, 1, 8, generator=g, dtype=torch.float64)
    z = z - (((fq * z).sum(-1) + 0.999 * eps) / (fq**2).sum(-1))[..., None] * fq  # phi(q)^T z = -0.999 eps
    S = torch.randn(1, 1, 8, 3, generator=g, dtype=torch.float64)
    out = {form: FORMS[form](q, k, v, feature_map=fm, initial_state={"S": S, "z": z, "pos": pos}, chunk_size=4, eps=eps, normalize=True)[0]
           for form in ("naive", "chunk", "recurrent", "step")}
    den = (fq * z).sum()
    assert -eps < den < 0
    for form in ("chunk", "recurrent", "step"):
        assert rel_err(out[form], out["naive"]) <= F64_TOL, form

