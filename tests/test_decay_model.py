"""LinearLM with a decay (cfg.decay: fixed / scalar / gla): every form inside the model, the gates against
their formulas, one layer against a hand-written recurrence, no new state, checkpoints, and the exported
graphs in ONNX Runtime.

Model-level comparisons run tiny models in float64 (relative error <= 1e-10); the exported graphs are held
to the fp32 budget of tests/exporters/test_parity.py (max abs <= 1e-4, relative L2 <= 1e-5).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from edgelin.config import FEATURE_MAPS, ModelConfig
from edgelin.layers.linear_attention import DECAYS
from edgelin.model import LinearLM
from edgelin.state import state_mismatch
from testkit import rel_err

TOL = 1e-10  # float64, relative: max|a - b| / max|b|
C = 8  # chunk of the float64 models
B = 3
LENGTHS = [pytest.param(t, id=f"T{t}") for t in (1, C - 1, C, C + 1, 3 * C + 5)]
DECAYED = ("fixed", "scalar", "gla")
VOCAB = 64


def config(decay: str, fm: str, **overrides) -> ModelConfig:
    cfg = dict(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=3, head_dim=8, chunk_size=C, feature_map=fm,
        normalisation="none" if fm == "identity" else "denominator", conv_size=4, decay=decay,
        n_features=12,  # performer: F != head_dim (and cosformer has F = 2 head_dim)
        cosformer_horizon=64, feature_seed=3, gate_rank=5,
    )
    return ModelConfig(**(cfg | overrides))


@functools.lru_cache(maxsize=None)
def model64(decay: str, fm: str) -> LinearLM:
    """float64, with sharpened projections (so data-dependent gates range from ~0 to ~1) and real conv taps."""
    torch.manual_seed(0)
    model = LinearLM(config(decay, fm)).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name != "embed.weight":
                p.mul_(8.0)
            elif name.endswith("norm.weight") or name.endswith("conv.weight"):
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith(("dt_bias", "A_log", "gate_up.bias")):
                p.add_(torch.randn_like(p))
    return model


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_states_close(got: dict, want: dict) -> None:
    assert not (why := state_mismatch(got, want, tol=TOL)), why


EVERY = [pytest.param(d, fm, id=f"{d}-{fm}") for d in DECAYED for fm in FEATURE_MAPS]


# ---- every form inside the model ------------------------------------------------------------------
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("decay, fm", EVERY)
@torch.no_grad()
def test_chunk_step_and_naive_agree(decay, fm, T):
    """forward (chunked) == the naive form == token-by-token steps, logits and state, batch 3."""
    model = model64(decay, fm)
    ids = token_ids(B, T, seed=T)
    naive, naive_state = model(ids, form="naive")
    chunk, chunk_state = model(ids)
    assert rel_err(chunk, naive) <= TOL
    assert_states_close(chunk_state, naive_state)
    state, steps = model.init_state(B), []
    for t in range(T):
        logits, state = model.step(ids[:, t : t + 1], state)
        steps.append(logits)
    assert rel_err(torch.cat(steps, dim=1), naive) <= TOL
    assert_states_close(state, naive_state)


@pytest.mark.parametrize("cut", [1, C, C + 3], ids=lambda c: f"cut{c}")
@pytest.mark.parametrize("decay, fm", EVERY)
@torch.no_grad()
def test_prefill_in_pieces_and_decode_continue_the_sequence(decay, fm, cut):
    """A chunked prefill from a carried (decayed) state continues the sequence; so do decode steps."""
    model = model64(decay, fm)
    T = 2 * C + 5
    ids = token_ids(B, T, seed=cut)
    whole, whole_state = model(ids, form="naive")
    a, state = model(ids[:, :cut])
    b, state_b = model(ids[:, cut:], state)
    assert rel_err(torch.cat([a, b], dim=1), whole) <= TOL
    assert_states_close(state_b, whole_state)
    for t in range(cut, T):
        logits, state = model.step(ids[:, t : t + 1], state)
        assert rel_err(logits[:, 0], whole[:, t]) <= TOL, f"position {t}"
    assert_states_close(state, whole_state)


@pytest.mark.parametrize("decay", DECAYED)
@torch.no_grad()
def test_future_tokens_do_not_change_past_logits(decay):
    """Causality of the whole decayed model in its prefill form: the gates read only the current token."""
    model = model64(decay, "relu")
    ids = token_ids(2, 2 * C + 3, seed=9)
    changed = ids.clone()
    changed[:, C + 1 :] = (changed[:, C + 1 :] + 7) % VOCAB
    a, _ = model(ids)
    b, _ = model(changed)
    assert rel_err(b[:, : C + 1], a[:, : C + 1]) <= TOL
    assert rel_err(b[:, C + 1 :], a[:, C + 1 :]) > 1e-3


# ---- the gates and one layer against independent formulas -----------------------------------------
def expected_gate(attn, x: torch.Tensor) -> torch.Tensor:
    """The log-decay of each decay written out from its definition (not from the module's code)."""
    cfg = attn.cfg
    Bx, T, _ = x.shape
    H, f = cfg.n_heads, attn.phi.out_dim
    if cfg.decay == "fixed":
        g = torch.tensor([math.log(1.0 - 2.0 ** (-5 - h)) for h in range(H)], dtype=x.dtype)  # [H]
        return g[None, :, None].expand(Bx, H, T)  # [B, H, T]
    d = attn.decay
    if cfg.decay == "scalar":
        g = torch.empty(Bx, H, T, dtype=x.dtype)
        for h in range(H):
            dt = F.softplus(x @ d.dt_proj.weight[h] + d.dt_bias[h])  # [B, T]
            g[:, h] = -torch.exp(d.A_log[h]) * dt
        return g
    logits = (x @ d.gate_down.weight.T) @ d.gate_up.weight.T + d.gate_up.bias  # [B, T, H * F]
    g = torch.empty(Bx, H, T, f, dtype=x.dtype)
    for h in range(H):
        g[:, h] = torch.log(torch.sigmoid(logits[..., h * f : (h + 1) * f])) / 16.0  # [B, T, F]
    return g


@pytest.mark.parametrize("decay, fm", EVERY)
@torch.no_grad()
def test_gate_matches_its_formula(decay, fm):
    attn = model64(decay, fm).blocks[1].attn
    x = torch.randn(2, 11, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = attn.decay(x)
    want = expected_gate(attn, x)
    assert g.shape == want.shape
    assert rel_err(g, want) <= TOL
    assert (g <= 0).all() and g.isfinite().all()
    if decay != "fixed":  # data-dependent: really varies with the token
        assert g.std(dim=2).min() > 1e-6


@pytest.mark.parametrize("decay, fm", EVERY)
@torch.no_grad()
def test_layer_matches_a_hand_written_decayed_recurrence(decay, fm):
    """One attention layer (conv, gate, projections, phi, decayed sums, output) against a plain loop:
    S_t = exp(g_t) S_{t-1} + phi(k_t) v_t^T, z likewise, y_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)."""
    attn = model64(decay, fm).blocks[0].attn
    cfg = attn.cfg
    Bx, T, H, D = 2, 2 * C + 3, cfg.n_heads, cfg.head_dim
    x = torch.randn(Bx, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got, _ = attn(x, None, form="chunk")

    g = expected_gate(attn, x)  # gates read the input before the conv
    if g.dim() == 3:
        g = g[..., None]  # [B, H, T, 1]
    w = attn.conv.weight[:, 0]  # [d, size]
    padded = torch.cat([x.new_zeros(Bx, cfg.conv_size - 1, 32), x], dim=1)
    mixed = torch.stack([(padded[:, t : t + cfg.conv_size] * w.T).sum(1) for t in range(T)], dim=1)  # [B, T, d]

    def heads(proj):
        return proj(mixed).view(Bx, T, H, D).transpose(1, 2)  # [B, H, T, D]

    pos = torch.arange(T)[None].expand(Bx, T)
    fq = attn.phi(heads(attn.q_proj), is_query=True, positions=pos)  # [B, H, T, F]
    fk = attn.phi(heads(attn.k_proj), is_query=False, positions=pos)
    v = heads(attn.v_proj)
    S = x.new_zeros(Bx, H, fq.shape[-1], D)
    z = x.new_zeros(Bx, H, fq.shape[-1])
    outs = []
    for t in range(T):
        a = g[:, :, t].exp()  # [B, H, F or 1]
        S = a[..., None] * S + fk[:, :, t, :, None] * v[:, :, t, None, :]
        z = a * z + fk[:, :, t]
        num = (fq[:, :, t, :, None] * S).sum(2)  # [B, H, D]
        if attn.normalize:
            den = (fq[:, :, t] * z).sum(-1, keepdim=True)  # [B, H, 1]
            num = num / torch.where(den >= 0, den + cfg.eps, den - cfg.eps)
        outs.append(num)
    o = torch.stack(outs, dim=2)  # [B, H, T, D]
    if attn.out_norm is not None:
        o = attn.out_norm(o)
    want = attn.o_proj(o.transpose(1, 2).reshape(Bx, T, H * D))
    assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("decay", DECAYED)
@torch.no_grad()
def test_decay_starts_near_one(decay):
    """At init (before any training) the state forgets slowly: every gate exp(g) lies in [0.8, 1) (the
    data-dependent term of "scalar" spreads its per-head 0.905..0.999 a little; "gla" sits near 0.958)."""
    torch.manual_seed(0)
    model = LinearLM(config(decay, "relu", d_model=128, n_heads=4, head_dim=32))
    x = model.blocks[0].attn_norm(model.embed(token_ids(2, 50)))  # what layer 0's gate reads
    gate = model.blocks[0].attn.decay(x).exp()
    assert gate.min() >= 0.8 and gate.max() < 1.0, (gate.min().item(), gate.max().item())
    if decay == "fixed":
        assert torch.allclose(gate[0, :, 0], torch.tensor([1 - 2.0**-5, 1 - 2.0**-6, 1 - 2.0**-7, 1 - 2.0**-8]))
    if decay == "scalar":  # a spread of memory lengths across heads, as RetNet's
        per_head = gate.mean(dim=(0, 2))  # [H]
        assert per_head[0] < 0.93 and per_head[-1] > 0.99


# ---- decay adds no state and leaves "none" as it was -------------------------------------------------
UNDECAYED_KEYS = {  # what a layer of a LinearLM with a conv holds, decay or not
    "attn_norm.weight", "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.o_proj.weight",
    "attn.conv.weight", "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight",
}
EXTRA_KEYS = {
    "none": {},
    "fixed": {},  # gamma is rebuilt from the config: nothing in the checkpoint
    "scalar": {"attn.decay.dt_proj.weight": (3, 32), "attn.decay.dt_bias": (3,), "attn.decay.A_log": (3,)},
    "gla": {"attn.decay.gate_down.weight": (5, 32), "attn.decay.gate_up.weight": (3 * 8, 5), "attn.decay.gate_up.bias": (3 * 8,)},
}


@pytest.mark.parametrize("decay", list(DECAYS))
def test_weights_and_state_contract(decay):
    model = LinearLM(config(decay, "elu+1"))
    plain = LinearLM(config("none", "elu+1"))
    assert model.state_specs() == plain.state_specs()
    sd = model.state_dict()
    for i in range(2):
        layer = {k[len(f"blocks.{i}."):]: tuple(t.shape) for k, t in sd.items() if k.startswith(f"blocks.{i}.")}
        assert set(layer) == UNDECAYED_KEYS | set(EXTRA_KEYS[decay])
        for k, shape in EXTRA_KEYS[decay].items():
            assert layer[k] == shape, k
    if decay == "none":
        assert all(block.attn.decay is None for block in model.blocks)


def test_decay_none_changes_nothing_in_an_old_model():
    """A config without the decay fields loads as decay "none"; its model runs with g = None."""
    data = config("none", "relu").to_dict()
    del data["decay"], data["gate_rank"]
    cfg = ModelConfig.from_dict(data)
    assert cfg.decay == "none"
    torch.manual_seed(0)
    model = LinearLM(cfg).double()
    calls = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append(kwargs.get("g"))
            return fn(*args, **kwargs)
        return wrapped

    from edgelin.layers import linear_attention as model_module

    original = model_module.FORMS["chunk"]
    model_module.FORMS["chunk"] = spy(original)
    try:
        model(token_ids(1, 5))
    finally:
        model_module.FORMS["chunk"] = original
    assert calls == [None, None]


@pytest.mark.parametrize("decay", DECAYED)
@torch.no_grad()
def test_decay_really_changes_the_model(decay):
    """The same weights without the decay give other logits (the gate reaches the attention)."""
    model = model64(decay, "relu")
    plain = LinearLM(config("none", "relu")).double().eval()
    plain.load_state_dict({k: t for k, t in model.state_dict().items() if ".decay." not in k})
    ids = token_ids(2, 3 * C)
    assert rel_err(model(ids)[0], plain(ids)[0]) > 1e-3


@pytest.mark.parametrize("decay", DECAYED)
@torch.no_grad()
def test_checkpoint_round_trip_and_chunk_change(decay, tmp_path):
    from edgelin.checkpoint import load_checkpoint, save_checkpoint

    model = model64(decay, "performer").float()
    try:
        ids = token_ids(2, 2 * C + 1)
        want, _ = model(ids)
        loaded = load_checkpoint(save_checkpoint(model, tmp_path / "ckpt")).eval()
        assert loaded.cfg == model.cfg
        assert torch.equal(loaded(ids)[0], want)
        other = model.with_chunk_size(2 * C)
        assert rel_err(other(ids)[0], want) <= 1e-5
    finally:
        model.double()


# ---- exported graphs ---------------------------------------------------------------------------------
# ONNX Runtime vs PyTorch for decayed exports (prefill at awkward T and batch 3, decode, prefill in pieces)
# runs in tests/exporters/test_parity.py, whose cases include the decays.


def test_exported_state_contract_is_the_undecayed_one(exported):
    from edgelin.runtime.manifest import Manifest

    plain = Manifest.load(exported("relu")[1])
    for decay in DECAYED:
        manifest = Manifest.load(exported("relu", decay=decay)[1])
        assert manifest.states == plain.states, decay
        assert manifest.model["decay"] == decay


def test_validate_passes_for_a_decayed_export(exported):
    from edgelin.validate import validate

    model, out = exported("relu", decay="gla")
    report = validate(out, model, steps=24, long=500)
    assert report.passed, report.table()
    assert {c.group for c in report.checks} >= {"structure", "prefill", "decode", "graphs", "long"}
    assert report.drift and report.drift[-1]["step"] >= 499
