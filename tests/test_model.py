"""LinearLM: prefill in pieces, prefill then decode, every attention form, batches, the state layout.

Tiny models in float64, one per feature map x normalisation x tie_embeddings, so every equality below is
exact up to float64 rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch

from edgelin.config import FEATURE_MAPS, NORMALISATIONS, ModelConfig
from edgelin.layers.feature_maps import make_feature_map
from edgelin.model import LinearLM
from edgelin.state import state_mismatch
from testkit import rel_err


TOL = 1e-10  # relative error in float64: max|a - b| / max|b|
B, T_TOTAL = 3, 30


def tiny_config(feature_map: str, normalisation: str = "denominator", tie: bool = True, decay: str = "none") -> ModelConfig:
    return ModelConfig(
        decay=decay,
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=8,
        feature_map=feature_map, normalisation=normalisation, tie_embeddings=tie,
        conv_size=0 if tie else 4,  # the untied variants also carry a short conv window in the state
        n_features=24,  # performer: F != head_dim
        cosformer_horizon=64,  # cosformer: positions up to 30 turn the angle by up to ~0.7 rad
        feature_seed=7,
    )


@functools.lru_cache(maxsize=None)
def tiny_model(feature_map: str, normalisation: str, tie: bool, decay: str = "none") -> LinearLM:
    torch.manual_seed(0)
    model = LinearLM(tiny_config(feature_map, normalisation, tie, decay)).double().eval()
    with torch.no_grad():  # RMSNorm weights start at 1: perturb them so a mixed-up norm would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("conv.weight"):  # conv starts as the identity
                p.add_(0.3 * torch.randn_like(p))
    return model


def token_ids(batch: int = B, length: int = T_TOTAL, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_states_close(got: dict, want: dict) -> None:
    assert not (why := state_mismatch(got, want, tol=TOL)), why


MODELS = [
    pytest.param(fm, norm, tie, id=f"{fm}-{norm}-{'tied' if tie else 'untied-conv4'}")
    for fm in FEATURE_MAPS
    for norm in NORMALISATIONS
    for tie in (True, False)
]


@pytest.mark.parametrize("cut", [1, 8, 13], ids=lambda c: f"cut{c}")
@pytest.mark.parametrize("fm, norm, tie", MODELS)
@torch.no_grad()
def test_prefill_in_two_pieces_equals_one(fm, norm, tie, cut):
    model = tiny_model(fm, norm, tie)
    ids = token_ids()
    logits, state = model(ids)
    assert logits.shape == (B, T_TOTAL, 64) and logits.dtype == torch.float64
    la, sa = model(ids[:, :cut])
    lb, sb = model(ids[:, cut:], sa)
    assert rel_err(torch.cat([la, lb], dim=1), logits) <= TOL
    assert_states_close(sb, state)


@pytest.mark.parametrize("fm, norm, tie", MODELS)
@torch.no_grad()
def test_decode_steps_continue_the_prefill(fm, norm, tie):
    model = tiny_model(fm, norm, tie)
    ids = token_ids()
    prompt = 11
    logits, state = model(ids)
    _, s = model(ids[:, :prompt])
    for t in range(prompt, T_TOTAL):
        step_logits, s = model.step(ids[:, t : t + 1], s)
        assert step_logits.shape == (B, 1, 64)
        assert rel_err(step_logits[:, 0], logits[:, t]) <= TOL, f"position {t}"
    assert_states_close(s, state)


@pytest.mark.parametrize("fm, norm, tie", MODELS)
@torch.no_grad()
def test_decode_from_a_fresh_state(fm, norm, tie):
    model = tiny_model(fm, norm, tie)
    ids = token_ids(length=5)
    logits, state = model(ids)
    s = model.init_state(B)
    for t in range(5):
        step_logits, s = model.step(ids[:, t : t + 1], s)
        assert rel_err(step_logits[:, 0], logits[:, t]) <= TOL
    assert_states_close(s, state)


@pytest.mark.parametrize("form", ["naive", "recurrent", "parallel"])
@pytest.mark.parametrize("fm, norm, tie", MODELS)
@torch.no_grad()
def test_every_form_gives_the_chunk_logits(fm, norm, tie, form):
    model = tiny_model(fm, norm, tie)
    ids = token_ids()
    logits, state = model(ids, form="chunk")
    other, other_state = model(ids, form=form)
    assert rel_err(other, logits) <= TOL
    assert_states_close(other_state, state)


@pytest.mark.parametrize("fm, decay", [(fm, "none") for fm in FEATURE_MAPS] + [("relu", d) for d in ("fixed", "scalar", "gla")])
@torch.no_grad()
def test_batch_rows_are_independent(fm, decay):
    """Row i of a batch gives what sequence i gives alone (the data-dependent decays' gates are per row)."""
    model = tiny_model(fm, "denominator", True, decay)
    ids = token_ids()
    logits, state = model(ids)
    for i in range(B):
        alone, alone_state = model(ids[i : i + 1])
        assert rel_err(logits[i : i + 1], alone) <= TOL
        assert_states_close({k: v[i : i + 1] for k, v in state.items()}, alone_state)


@pytest.mark.parametrize("fm, norm, tie", MODELS)
def test_state_specs_and_init_state_agree(fm, norm, tie):
    model = LinearLM(tiny_config(fm, norm, tie))  # float32: the specs' dtype names are the export's
    layout = {s.key: (s.shape, s.dtype, s.init) for s in model.state_specs()}
    for s in model.state_specs():
        assert (s.input, s.output) == (f"state.{s.key}", f"present.{s.key}")
    for batch in (1, 3):
        state = model.init_state(batch)
        assert list(state) == list(layout)
        for key, (shape, dtype_name, init) in layout.items():
            assert tuple(state[key].shape) == tuple(batch if d == "batch" else d for d in shape), key
            assert str(state[key].dtype) == f"torch.{dtype_name}", key
            assert (state[key] == init).all(), key
    cfg = model.cfg
    per_layer = {"S": ("batch", cfg.n_heads, cfg.feature_dim, cfg.head_dim)}
    if norm == "denominator":
        per_layer["z"] = ("batch", cfg.n_heads, cfg.feature_dim)
    if fm == "cosformer":
        per_layer["pos"] = ("batch",)
    if cfg.conv_size:
        per_layer["conv"] = ("batch", cfg.conv_size - 1, cfg.d_model)
    expected = [f"{layer}.{name}" for layer in range(cfg.n_layers) for name in per_layer]
    assert list(layout) == expected
    for key, (shape, _, _) in layout.items():
        assert tuple(shape) == per_layer[key.split(".", 1)[1]]

    # what forward and step return has the same keys, shapes and dtypes
    with torch.no_grad():
        _, after = model(token_ids(batch=3, length=4))
        _, stepped = model.step(token_ids(batch=3, length=1), after)
    fresh = model.init_state(3)
    for s in (after, stepped):
        assert list(s) == list(fresh)
        for key in fresh:
            assert s[key].shape == fresh[key].shape and s[key].dtype == fresh[key].dtype, key


@pytest.mark.parametrize("fm", FEATURE_MAPS)
def test_init_state_follows_the_model_dtype(fm):
    state = tiny_model(fm, "denominator", True).init_state(2)
    for key, t in state.items():
        assert t.dtype == (torch.int64 if key.endswith(".pos") else torch.float64), key


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_tie_embeddings(tie):
    model = LinearLM(tiny_config("elu+1", tie=tie))
    names = set(model.state_dict())
    other = LinearLM(tiny_config("elu+1", tie=tie).replace(tie_embeddings=not tie))
    if tie:
        assert model.lm_head is None and "lm_head.weight" not in names
        assert other.num_parameters() - model.num_parameters() == 64 * 32
    else:
        assert model.state_dict()["lm_head.weight"].shape == (64, 32)
    # the head really is (or is not) the embedding: changing the embedding of token 5 moves logit 5
    ids = token_ids(batch=1, length=3)
    with torch.no_grad():
        before, _ = model(ids)
        model.embed.weight[5] += 1.0
        after, _ = model(ids)
    # token 5 is not in the input, so only the head can move logit 5
    assert 5 not in ids.tolist()[0]
    moved = (after - before).abs()
    assert (moved[..., 5].max() > 1e-3) == tie
    assert moved[..., [i for i in range(64) if i != 5]].max() == 0


def test_performer_layers_use_consecutive_seeds():
    model = LinearLM(tiny_config("performer"))
    for i, block in enumerate(model.blocks):
        expected = make_feature_map("performer", 16, n_features=24, seed=7 + i).projection
        assert torch.equal(block.attn.phi.projection, expected)
    assert not torch.equal(model.blocks[0].attn.phi.projection, model.blocks[1].attn.phi.projection)
