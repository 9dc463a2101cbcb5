"""Ragged prefill in PyTorch: LinearLM.forward(ids, state, lengths=...) on right-padded rows of different
lengths against forward of each row alone, in float64: every position's logits up to the row's length,
every state tensor (S, z, pos, conv), and the decode steps that continue from it.

The exported graph and the runtime are tested in tests/exporters/test_ragged_export.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from edgelin.config import ModelConfig
from edgelin.model import LinearLM
from edgelin.ops import FORMS
from edgelin.ops.lengths import mask_padding
from testkit import rel_err

TOL = 1e-10  # float64, relative: max|a - b| / max|b|
C = 8  # chunk
VOCAB = 64
ROW_LENGTHS = (1, C - 1, C, C + 1, 3 * C + 5)  # one row of each: batch 5, T = 3 C + 5

# (feature map, normalisation, conv_size, decay): the bundled model's kind first
CONFIGS = {
    "bundled-relu-conv4-scalar": ("relu", "denominator", 4, "scalar"),
    "no-conv": ("relu", "denominator", 0, "scalar"),
    "elu1-denominator-decay-none": ("elu+1", "denominator", 4, "none"),
    "decay-fixed": ("relu", "denominator", 4, "fixed"),
    "decay-gla": ("relu", "denominator", 4, "gla"),
    "cosformer-pos": ("cosformer", "denominator", 4, "none"),
    "cosformer-gla": ("cosformer", "denominator", 2, "gla"),
    "identity-no-denominator": ("identity", "none", 3, "scalar"),
}
CASES = [pytest.param(name, id=name) for name in CONFIGS]


@functools.lru_cache(maxsize=None)
def model64(name: str) -> LinearLM:
    """float64, with sharpened projections (data-dependent gates well away from 1) and real conv taps."""
    fm, norm, conv, decay = CONFIGS[name]
    cfg = ModelConfig(
        vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, head_dim=8, chunk_size=C, feature_map=fm,
        normalisation=norm, conv_size=conv, decay=decay, cosformer_horizon=64, feature_seed=3, gate_rank=5,
    )
    torch.manual_seed(0)
    model = LinearLM(cfg).double().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 2 and pname != "embed.weight":
                p.mul_(8.0)
            elif pname.endswith(("norm.weight", "conv.weight")):
                p.add_(0.3 * torch.randn_like(p))
            elif pname.endswith(("dt_bias", "A_log", "gate_up.bias")):
                p.add_(torch.randn_like(p))
    return model


def padded(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T] right-padded with ``pad``, lengths [B])."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = r
    return ids, torch.tensor([len(r) for r in rows])


def row_state(state: dict, b: int) -> dict:
    return {k: t[b : b + 1] for k, t in state.items()}


def start_state(model: LinearLM, batch: int, seed: int) -> dict:
    """A state mid-sequence (each row after its own random prefix), so the test starts from non-zero S, z, conv, pos."""
    gen = torch.Generator().manual_seed(seed)
    state = model.init_state(batch)
    with torch.no_grad():
        for b in range(batch):
            prefix = torch.randint(0, VOCAB, (1, 3 + 2 * b), generator=gen)
            _, st = model(prefix, row_state(state, b))
            for k in state:
                state[k] = torch.cat([state[k][:b], st[k], state[k][b + 1 :]])
    return state


def assert_rows_match(model, ids, lengths, state, form="chunk"):
    """forward on the ragged batch == forward on each row alone: logits at every real position, every state,
    then three decode steps from each."""
    with torch.no_grad():
        logits, new = model(ids, state, form=form, lengths=lengths)
        assert set(new) == {s.key for s in model.state_specs()}
        nxt = torch.randint(0, VOCAB, (ids.shape[0], 3), generator=torch.Generator().manual_seed(1))
        batched = new
        steps = []
        for t in range(3):
            out, batched = model.step(nxt[:, t : t + 1], batched)
            steps.append(out)
        for b, L in enumerate(lengths.tolist()):
            st = row_state(state, b)
            if L > 0:
                ref, st = model(ids[b : b + 1, :L], st, form=form)
                assert rel_err(logits[b, :L], ref[0]) <= TOL, f"row {b} (length {L}): logits"
            for key in new:
                if new[key].dtype == torch.int64:
                    assert torch.equal(new[key][b], st[key][0]), f"row {b}: {key}"
                else:
                    assert rel_err(new[key][b], st[key][0]) <= TOL, f"row {b} (length {L}): state {key}"
            for t in range(3):
                out, st = model.step(nxt[b : b + 1, t : t + 1], st)
                assert rel_err(steps[t][b], out[0]) <= TOL, f"row {b}: decode step {t} after the ragged prefill"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "from-state"])
def test_ragged_forward_equals_each_row_alone(name, fresh):
    model = model64(name)
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, VOCAB, (L,), generator=gen) for L in ROW_LENGTHS]
    ids, lengths = padded(rows, pad=VOCAB - 1)
    state = model.init_state(len(rows)) if fresh else start_state(model, len(rows), seed=3)
    assert_rows_match(model, ids, lengths, state)


@pytest.mark.parametrize("form", ["naive", "parallel"])
def test_ragged_reference_forms(form):
    """The naive (reference) and parallel forms take lengths too, with the same meaning."""
    model = model64("bundled-relu-conv4-scalar")
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, VOCAB, (L,), generator=gen) for L in (C + 1, 2, C)]
    ids, lengths = padded(rows)
    assert_rows_match(model, ids, lengths, start_state(model, 3, seed=4), form=form)


@pytest.mark.parametrize("name", ["bundled-relu-conv4-scalar", "cosformer-pos"])
def test_length_zero_leaves_the_row_as_it_was(name):
    """A row with no real token in this call (a later piece of a shorter prompt) keeps its state exactly."""
    model = model64(name)
    ids = torch.randint(0, VOCAB, (2, C + 3), generator=torch.Generator().manual_seed(5))
    state = start_state(model, 2, seed=6)
    with torch.no_grad():
        _, new = model(ids, state, lengths=torch.tensor([C + 3, 0]))
    for key in new:
        assert torch.equal(new[key][1], state[key][1]), key


@pytest.mark.parametrize("name", ["bundled-relu-conv4-scalar", "decay-gla", "cosformer-pos"])
def test_equal_lengths_change_nothing(name):
    """lengths = T for every row gives exactly (bit for bit) what forward without lengths gives."""
    model = model64(name).float()
    try:
        ids = torch.randint(0, VOCAB, (3, 2 * C + 3), generator=torch.Generator().manual_seed(8))
        state = start_state(model, 3, seed=9)
        with torch.no_grad():
            a, sa = model(ids, state)
            b, sb = model(ids, state, lengths=torch.full((3,), 2 * C + 3))
        assert torch.equal(a, b)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    finally:
        model.double()


def test_bad_lengths_are_refused():
    model = model64("no-conv")
    ids = torch.zeros(2, 5, dtype=torch.int64)
    for lengths, msg in (
        (torch.tensor([5, 6]), r"lengths\[1\] is 6"),
        (torch.tensor([-1, 2]), r"lengths\[0\] is -1"),
        (torch.tensor([5]), r"shape \[B\] = \[2\]"),
        (torch.tensor([5.0, 5.0]), "integer tensor"),
        (torch.tensor([True, False]), "integer tensor"),
    ):
        with pytest.raises(ValueError, match=msg):
            model(ids, lengths=lengths)
    for form in ("step", "recurrent"):
        with pytest.raises(ValueError, match=f"the {form} form takes no lengths"):
            model(ids[:, :1], lengths=torch.tensor([1, 1]), form=form)


def test_mask_padding_without_lengths_is_the_identity():
    fk, v, g = torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), torch.zeros(1, 1, 3)
    out = mask_padding(fk, v, g, None)
    assert out[0] is fk and out[1] is v and out[2] is g


def test_every_sequence_form_but_recurrent_takes_lengths():
    """The forms the prefill graph and the references use; the token-by-token ones need no padding."""
    import inspect

    takes = {name for name, fn in FORMS.items() if "lengths" in inspect.signature(fn).parameters}
    assert {"chunk", "naive", "parallel"} <= takes
