"""Softmax attention with a KV cache (edgelin.layers.attention) and hybrid stacks of it with linear attention.

The layer against an independent float64 reference (torch's SDPA over the whole sequence, RoPE written here as a
complex rotation) at awkward lengths, with grouped heads, windows, partial rotary, biases, q/k norms and the output
gate; the cache carried across pieces and steps; rows of different lengths stacked with left-padded caches; the
hybrid LinearLM's forms and refusals; one hybrid export run in ONNX Runtime through the torch-free runtime
(pieces, decode, prefill_batch of different lengths, save/load, fork, the context limit, the memory it reports).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgelin.layers.attention import Attention, AttentionOptions, sdpa_reference
from edgelin.config import ModelConfig
from edgelin.errors import RuntimeInputError
from edgelin.model import LinearLM
from testkit import rel_err

D_MODEL = 32


def layer(seed: int = 0, **options) -> Attention:
    torch.manual_seed(seed)
    o = AttentionOptions(**{"d_model": D_MODEL, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **options})
    a = Attention(o).double().eval()
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.3 * torch.randn_like(p))  # sharper than init: attention weights far from uniform
    return a


def fresh(a: Attention, B: int) -> dict:
    o = a.o
    return {
        "key": torch.zeros(B, o.num_kv_heads, 0, o.head_dim, dtype=torch.float64),
        "value": torch.zeros(B, o.num_kv_heads, 0, o.head_dim, dtype=torch.float64),
        "pos": torch.zeros(B, dtype=torch.int64),
    }


def rope_complex(x: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    """RoPE by halves as a complex rotation (independent of edgelin.layers.attention.rotate): feature i pairs with
    i + rotary/2 and turns by angle t * theta^(-2i/rotary) at position t; features past ``rotary`` stay. The
    angles and their cos and sin are float32, as fla and transformers compute them (a checkpoint was trained so)."""
    T = x.shape[2]
    half = rotary // 2
    freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) * 2 / rotary)  # float32 throughout
    angles = torch.arange(T, dtype=torch.float32)[:, None] * freq
    turn = torch.complex(angles.cos().double(), angles.sin().double())
    z = torch.complex(x[..., :half], x[..., half:rotary]) * turn
    return torch.cat([z.real, z.imag, x[..., rotary:]], dim=-1)


def reference(a: Attention, x: torch.Tensor) -> torch.Tensor:
    """The layer over a whole sequence from position 0, written from the formulas: float64 SDPA."""
    o = a.o
    B, T, _ = x.shape

    def heads(t, h, norm=None):
        t = t.view(B, T, h, o.head_dim)
        if norm is not None:
            t = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + o.norm_eps) * norm.weight
        return t.transpose(1, 2)

    rotary = o.rotary_dim or o.head_dim
    q = rope_complex(heads(a.q_proj(x), o.num_heads, a.q_norm), rotary, o.rope_theta)
    k = rope_complex(heads(a.k_proj(x), o.num_kv_heads, a.k_norm), rotary, o.rope_theta)
    v = heads(a.v_proj(x), o.num_kv_heads)
    y = sdpa_reference(q, k, v, window=o.window, groups=o.num_heads // o.num_kv_heads)  # [B, H, T, D]
    y = y.transpose(1, 2).reshape(B, T, -1)
    if a.g_proj is not None:
        y = y * torch.sigmoid(a.g_proj(x))
    return a.o_proj(y)


VARIANTS = {
    "gqa": {},
    "mha-bias": {"num_kv_heads": 4, "qkv_bias": True},
    "mqa-window5": {"num_kv_heads": 1, "window": 5},
    "partial_rotary-gate-qknorm": {"rotary_dim": 4, "output_gate": True, "qk_norm": True, "rope_theta": 1e6},
    "window1": {"window": 1},
}


@pytest.mark.parametrize("T", [1, 15, 16, 17, 70])
@pytest.mark.parametrize("variant", list(VARIANTS))
@torch.no_grad()
def test_layer_matches_float64_sdpa(variant, T):
    a = layer(**VARIANTS[variant])
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    want = reference(a, x)
    for form in ("chunk", "naive"):
        got, state = a(x, fresh(a, 2), form=form)
        assert rel_err(got, want) < 1e-12, form
    window = VARIANTS[variant].get("window")
    assert state["key"].shape[2] == (T if window is None else min(T, window))
    assert state["pos"].tolist() == [T, T]


@pytest.mark.parametrize("variant", ["gqa", "mqa-window5", "partial_rotary-gate-qknorm"])
@torch.no_grad()
def test_cache_carries_across_pieces_and_steps(variant):
    """Prefill in pieces of 7, 1 and 9 tokens, then 5 single steps = the whole sequence at once."""
    a = layer(**VARIANTS[variant])
    x = torch.randn(3, 22, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = reference(a, x)
    state, outs, start = fresh(a, 3), [], 0
    for n in (7, 1, 9, 1, 1, 1, 1, 1):
        y, state = a(x[:, start : start + n], state, form="step" if n == 1 else "chunk")
        outs.append(y)
        start += n
    assert rel_err(torch.cat(outs, 1), want) < 1e-12


@torch.no_grad()
def test_rows_of_different_lengths_share_a_batch_with_left_padded_caches():
    """Two rows prefilled alone (lengths 4 and 11), their caches left-padded with garbage to one batch: each row's
    next steps are those of the row alone (padding is masked by the row's position, whatever it holds)."""
    a = layer(**VARIANTS["mqa-window5"] | {"window": None})
    xs = [torch.randn(1, n, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) for n in (4, 11)]
    states = [a(x, fresh(a, 1))[1] for x in xs]
    pad = 11 - 4
    junk = torch.full((1, a.o.num_kv_heads, pad, a.o.head_dim), 1e3, dtype=torch.float64)
    batch = {
        "key": torch.cat([torch.cat([junk, states[0]["key"]], 2), states[1]["key"]]),
        "value": torch.cat([torch.cat([junk, states[0]["value"]], 2), states[1]["value"]]),
        "pos": torch.cat([states[0]["pos"], states[1]["pos"]]),
    }
    step = torch.randn(2, 3, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got, _ = a(step, batch)
    for b in range(2):
        alone, _ = a(step[b : b + 1], states[b])
        assert rel_err(got[b : b + 1], alone) < 1e-12


@torch.no_grad()
def test_the_layers_of_a_call_share_its_positions_angles_and_masks():
    """Attention layers of different windows, rotary widths and thetas in one model: each reads the positions, RoPE
    angles and mask of its own kind from the call's carry (computed once by the first layer that needs them), and the
    model computes what it does with every layer computing its own, in pieces, steps and a batch of two rows."""
    from edgelin.skeleton import CausalLM

    options = [{}, {"window": 5}, {"rotary_dim": 4, "rope_theta": 1e6}, {"window": 5, "num_kv_heads": 1}, {}]
    torch.manual_seed(0)
    model = CausalLM(lambda i: Attention(AttentionOptions(**{"d_model": D_MODEL, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, **options[i]})),
                     n_layers=len(options), vocab_size=256, d_model=D_MODEL, mlp_hidden=48, norm_eps=1e-5, tie_embeddings=True, chunk_size=16,
                     config={"family": "test/attention-kinds"}).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = tokens(2, 22, seed=4)
    runs = {}
    for shared in (True, False):
        for b in model.blocks:
            b.attn.uses_carry = shared  # False: the block hands no carry, every layer computes its own
        state, outs, start = model.init_state(2), [], 0
        state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
        for n in (7, 9, 1, 1, 1, 1, 1, 1):
            y, state = model(ids[:, start : start + n], state, form="step" if n == 1 else "chunk")
            outs.append(y)
            start += n
        runs[shared] = torch.cat(outs, 1), state
    for b in model.blocks:
        del b.attn.uses_carry
    assert rel_err(runs[True][0], runs[False][0]) < 1e-12
    for key, value in runs[False][1].items():
        assert torch.equal(runs[True][1][key], value), key
    want, _ = model(ids, form="naive")  # the per-query loop, its layers sharing too
    assert rel_err(runs[True][0], want) < 1e-10


def test_bad_layer_options_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads"):
        Attention(AttentionOptions(d_model=32, num_heads=4, num_kv_heads=3, head_dim=8))
    with pytest.raises(ValueError, match="rotary"):
        Attention(AttentionOptions(d_model=32, num_heads=4, num_kv_heads=4, head_dim=8, rotary_dim=3))


# ---- the hybrid LinearLM ----------------------------------------------------------------------------------------


def hybrid(seed: int = 0, **overrides) -> LinearLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=256, d_model=32, n_layers=3, n_heads=2, head_dim=16, chunk_size=16, feature_map="elu+1",
        conv_size=4, decay="scalar", attn_layers=[1], attn_kv_heads=1,
    )
    m = LinearLM(ModelConfig(**(cfg | overrides))).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    return m


def tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [0, 6])
@torch.no_grad()
def test_hybrid_forms_agree_in_float64(window):
    m = hybrid(attn_window=window).double()
    ids = tokens(2, 37)
    want, _ = m(ids, form="naive")
    got, state = m(ids)
    assert rel_err(got, want) < 1e-10
    outs, s = [], m.init_state(2)
    s = {k: v.double() if v.is_floating_point() else v for k, v in s.items()}
    for t in range(37):
        y, s = m.step(ids[:, t : t + 1], s)
        outs.append(y)
    assert rel_err(torch.cat(outs, 1), want) < 1e-10
    assert [k for k in state if k.startswith("1.")] == ["1.key", "1.value", "1.pos"]
    assert state["1.key"].shape == (2, 1, 37 if not window else window, 16)


def test_hybrid_state_contract():
    m = hybrid(attn_window=6)
    specs = {s.key: s for s in m.state_specs()}
    assert specs["1.key"].shape == ("batch", 1, "past", 16) and specs["1.key"].window == 6 and specs["1.key"].grows
    assert not specs["0.S"].grows and specs["0.S"].window is None
    assert m.state_decays  # the linear layers decay, the cache holds activations: float16 states allowed
    assert not hybrid(decay="none").state_decays
    assert not m.accepts_lengths
    with pytest.raises(ValueError, match="attention"):
        m(tokens(2, 5), lengths=torch.tensor([5, 3]))
    with pytest.raises(ValueError, match=r"layer 1 \(attention\) .*not 'parallel'"):
        m(tokens(2, 5), form="parallel")


# ---- exported: the torch-free runtime ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_export(export_of):
    m = hybrid(attn_window=0, max_positions=1100)
    return m, export_of(m, {"test_attention.hybrid": m.model_config()}, label="hybrid", check=False)


@torch.no_grad()
def test_exported_hybrid_runs_in_pieces_and_steps(hybrid_export):
    import edgelin.runtime as rt

    m, out = hybrid_export
    s = rt.load(out, provider="cpu")
    assert s.manifest.grows and s.manifest.max_positions == 1100
    ids = tokens(3, 50, seed=3)
    want, _ = m(ids)
    state = s.new_state(3)
    assert state.past == 0
    got = [s.prefill(ids[:, :30].numpy(), state, chunk=7)]
    assert state.past == 30
    got += [s.decode(ids[:, t : t + 1].numpy(), state) for t in range(30, 50)]
    assert state.past == 50
    assert np.abs(np.concatenate(got, 1) - want.numpy()).max() < 1e-4
    assert state.nbytes() == s.manifest.state_bytes(3, 50) > s.manifest.state_bytes(3, 0)
    # IO binding asked for later (as the bench does) is not taken: the KV caches change shape every call
    s.io_binding = True
    assert not s.io_binding
    s.decode(ids[:, 49:50].numpy(), state)  # bound outputs of the old shape made ONNX Runtime refuse this step
    assert state.past == 51


@torch.no_grad()
def test_exported_hybrid_batches_prompts_of_different_lengths(hybrid_export, tmp_path):
    import edgelin.runtime as rt

    m, out = hybrid_export
    s = rt.load(out, provider="cpu")
    prompts = [tokens(1, n, seed=n)[0].numpy() for n in (9, 26, 2)]
    last, state = s.prefill_batch(prompts)
    assert state.past == 26
    nxt = np.array([[5], [6], [7]])
    step = s.decode(nxt, state)
    for b, p in enumerate(prompts):
        full, _ = m(torch.tensor(np.append(p, nxt[b]))[None])
        assert np.abs(last[b] - full[0, -2].numpy()).max() < 1e-4
        assert np.abs(step[b, 0] - full[0, -1].numpy()).max() < 1e-4
    state.save(tmp_path / "s.npz")
    again = s.load_state(tmp_path / "s.npz")
    fork = again.fork()
    a, b = s.decode(nxt, again), s.decode(nxt, fork)
    assert np.array_equal(a, b) and again.past == fork.past == 28


def test_exported_hybrid_refuses_bad_caches_and_the_context_limit(hybrid_export):
    import edgelin.runtime as rt

    _, out = hybrid_export
    s = rt.load(out, provider="cpu")
    arrays = s.new_state(2).numpy()
    arrays["state.1.key"] = np.zeros((2, 1, 4, 16), np.float32)  # 4 positions, the value cache 0
    with pytest.raises(RuntimeInputError, match="1.value.*positions|1.key.*positions"):
        rt.State.from_arrays(s.manifest, arrays)
    arrays["state.1.key"] = np.zeros((3, 1, 0, 16), np.float32)  # another batch
    with pytest.raises(RuntimeInputError, match="state.1.key"):
        rt.State.from_arrays(s.manifest, arrays)
    state = s.new_state(1)
    s.prefill(np.zeros((1, 1090), np.int64), state, chunk=512)
    with pytest.raises(RuntimeInputError, match="context of 1,100 positions"):
        s.prefill(np.zeros((1, 11), np.int64), state)
    for _ in range(10):
        s.decode(np.zeros((1, 1), np.int64), state)
    with pytest.raises(RuntimeInputError, match="max_positions"):
        s.decode(np.zeros((1, 1), np.int64), state)


def test_a_window_larger_than_the_context_limit_is_refused():
    from edgelin.errors import ConfigError

    with pytest.raises(ConfigError, match="attn_window"):
        hybrid(attn_window=128, max_positions=64)



def test_generate_reports_the_growing_state(hybrid_export):
    """generate_text (and the CLI's summary line) says how much a hybrid's KV cache holds at the end."""
    import edgelin.runtime as rt
    from edgelin.cli.generate import _summary

    _, out = hybrid_export
    s = rt.load(out, provider="cpu")
    r = rt.generate_text(s, prompt_ids=[1, 2, 3, 4], max_new_tokens=6, min_new_tokens=6)
    assert r["state_grows"] and r["state_positions"] == 10
    assert r["state_bytes"] == s.manifest.state_bytes(1, 10) > s.manifest.state_bytes(1, 0)
    assert "KV cache of 10 positions" in _summary(r)



@torch.no_grad()
def test_exported_kv_cache_after_1k_tokens_matches_float64(hybrid_export):
    """1,000 tokens prefilled through the graphs in pieces of 256: the KV cache (keys after RoPE, values) and the
    last logits against the float64 PyTorch model (whose attention matches float64 SDPA above)."""
    import copy

    import edgelin.runtime as rt
    from testkit import rel_l2

    m, out = hybrid_export
    ids = tokens(1, 1000, seed=11)
    want_logits, want = copy.deepcopy(m).double()(ids)
    s = rt.load(out, provider="cpu")
    state = s.new_state(1)
    last = s.prefill(ids.numpy(), state, chunk=256, last_only=True)
    got = state.numpy()
    assert got["state.1.key"].shape == (1, 1, 1000, 16)
    for name in ("key", "value"):
        assert rel_l2(got[f"state.1.{name}"], want[f"1.{name}"].numpy()) < 1e-5
    assert np.abs(last[0] - want_logits[0, -1].numpy()).max() < 1e-4
    assert got["state.1.pos"].tolist() == [1000]


@pytest.mark.parametrize("precision, state_dtype", [("fp16", "float32"), ("fp16", "float16"), ("int8", "float32"), ("int4", "float32")])
@torch.no_grad()
def test_a_hybrid_exports_in_every_precision(export_of, precision, state_dtype):
    """A hybrid (a KV cache among linear layers) in fp16 (with fp32 or fp16 states, KV cache included), int8 and int4:
    the export's smoke check (ONNX Runtime vs PyTorch within the precision's budgets) passes, and the graphs decode
    on through the runtime with a cache that grows, in the state's declared dtype."""
    import edgelin.runtime as rt
    from edgelin.runtime import Manifest

    m = hybrid(attn_window=0, max_positions=1100)
    out = export_of(m, {"test_attention.hybrid": m.model_config()}, label=f"hybrid-{precision}-{state_dtype}",
                    precision=precision, state_dtype=state_dtype)  # the smoke check runs (and raises on failure)
    manifest = Manifest.load(out)
    assert manifest.precision == precision and manifest.grows
    s = rt.load(out, provider="cpu")
    state = s.new_state(2)
    ids = tokens(2, 40, seed=5)
    want, _ = m(ids)
    got = [s.prefill(ids[:, :32].numpy(), state, chunk=16)] + [s.decode(ids[:, t : t + 1].numpy(), state) for t in range(32, 40)]
    assert state.past == 40
    arrays = state.numpy()
    assert arrays["state.1.key"].shape == (2, 1, 40, 16)
    assert arrays["state.1.key"].dtype == np.dtype(state_dtype)
    got = np.concatenate(got, 1)
    assert np.isfinite(got).all()
    # the greedy choice mostly agrees with the fp32 model (a loose sanity bound; the budgets are the smoke check's)
    assert (got.argmax(-1) == want.numpy().argmax(-1)).mean() > 0.8


def _kv_checks(report):
    return [c for c in report.checks if c.group == "kv"]


def test_validate_checks_the_kv_cache_after_long_prompts(hybrid_export):
    """validate's kv group on a hybrid whose context is 1,100: the cache after 1,024 tokens (prefilled in the runtime's
    pieces) against the float64 model passes; 16,384 is past the context and says so; a cache written wrong after
    long prompts (the key cache of layer 1 off by 1e-3 relative, as a RoPE bug at large positions would be) fails,
    naming the layer and the state, while every other check passes."""
    from edgelin.runtime.session import Session
    from edgelin.runtime.state import State
    from edgelin.validate import validate

    m, out = hybrid_export
    report = validate(out, m, steps=8, kv=(1024, 16384))
    kv = _kv_checks(report)
    assert [(c.name, c.status) for c in kv] == [("1,024 tokens prefilled vs float64", "pass"), ("16,384 tokens prefilled vs float64", "n/a")]
    assert "past the model's context of 1,100" in kv[1].where and report.passed
    assert _kv_checks(validate(out, m, steps=8, kv=())) == []

    real = Session.prefill

    def skewed(self, input_ids, state, **kw):
        logits = real(self, input_ids, state, **kw)
        if state.past >= 1000:  # only the long prompts: the other checks prefill at most a few chunks
            arrays = state.numpy()
            arrays["state.1.key"] = arrays["state.1.key"] * np.float32(1 + 1e-3)
            state.__dict__.update(State.from_arrays(self.manifest, arrays).__dict__)  # the same State, its values replaced
        return logits

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Session, "prefill", skewed)
        bad = validate(out, m, steps=8, kv=(1024,))
    kv = _kv_checks(bad)
    assert kv[0].status == "fail" and "layer 1, state key" in kv[0].where, kv[0]
    assert all(c.status != "fail" for c in bad.checks if c.group != "kv")


@torch.no_grad()
def test_validate_checks_a_full_kv_cache_after_16k_tokens(export_of):
    """A hybrid without a context limit: its KV cache after 16,384 tokens (in the runtime's pieces) against float64."""
    from edgelin.validate import validate

    m = hybrid(seed=1)
    out = export_of(m, {"test_attention.hybrid": m.model_config(), "seed": 1}, label="hybrid-unbounded", check=False)
    kv = _kv_checks(validate(out, m, steps=4, kv=(16384,)))
    assert [(c.name, c.status) for c in kv] == [("16,384 tokens prefilled vs float64", "pass")], kv
