"""edgelin.layerwise: a model run with its weights converted one layer at a time equals the converted copy of the
whole model (``copy.deepcopy(model).double()``), holds one layer's converted weights at a time, and leaves the model
exactly as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_model
from edgelin import layerwise
from edgelin.state import fresh_state


def _run(model, ids, steps, dtype):
    state = fresh_state(model.state_specs(), ids.shape[0], dtype=dtype)
    with torch.no_grad():
        logits, state = model(ids, state)
        out = [logits]
        for t in range(steps.shape[1]):
            step, state = model.step(steps[:, t:t + 1], state)
            out.append(step)
    return out, state


@pytest.mark.parametrize("keep", [False, True], ids=["each-call", "kept"])
@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": False, "attn_layers": (1,), "n_layers": 3}], ids=["tied", "untied-hybrid"])
def test_converted_equals_the_float64_copy(keep, overrides):
    model = tiny_model(**overrides)
    before = {n: (p, p.dtype, p.clone()) for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    ids, steps = torch.randint(0, 256, (2, 17), generator=gen), torch.randint(0, 256, (2, 3), generator=gen)  # chunk + 1
    want, want_state = _run(copy.deepcopy(model).double(), ids, steps, torch.float64)
    view = layerwise.Converted(model, keep=keep)
    got, got_state = _run(view, ids, steps, torch.float64)  # the state carried from call to call, in float64
    for g, w in zip(got, want):
        assert g.dtype == torch.float64 and torch.equal(g, w)
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
    # the model itself is untouched: the same parameter objects, float32, the same values; it still runs in float32
    for n, p in model.named_parameters():
        assert p is before[n][0] and p.dtype == before[n][1] and torch.equal(p, before[n][2]), n
    assert _run(model, ids, steps, torch.float32)[0][0].dtype == torch.float32


def test_one_layer_converted_at_a_time():
    """While layer i runs, its weights and those outside the layers are float64; every other layer's are float32."""
    model = tiny_model(n_layers=3)
    seen = []

    def look(i):
        def hook(_m, _a):
            seen.append([{p.dtype for p in b.parameters()} for b in model.blocks] + [{model.embed.weight.dtype}])
        return hook

    with layerwise.converted(model):
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(look(i))  # after the conversion's own: it sees the layer converted
        model(torch.zeros(1, 4, dtype=torch.long), fresh_state(model.state_specs(), 1, dtype=torch.float64))
    assert len(seen) == 3
    for i, layers in enumerate(seen):
        for j, dtypes in enumerate(layers[:3]):
            assert dtypes == ({torch.float64} if j == i else {torch.float32}), (i, j, dtypes)
        assert layers[3] == {torch.float64}
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_failing_layer_leaves_the_model_as_it_was():
    model = tiny_model()
    params = list(model.parameters())

    def boom(_m, _a):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"), layerwise.converted(model):
        model(torch.zeros(1, 4, dtype=torch.long), fresh_state(model.state_specs(), 1, dtype=torch.float64))
    handle.remove()
    assert list(model.parameters()) == params and all(p.dtype == torch.float32 for p in params)
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in model.blocks)


def test_fits_converted_plans_from_the_weights():
    model = tiny_model()
    size = layerwise.weight_bytes(model)
    assert size == sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())
    assert layerwise.fits_converted(model, available=4 * size)
    assert not layerwise.fits_converted(model, available=4 * size - 1)


class _Layer(torch.nn.Module):
    def __init__(self, shared=None):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        if shared is not None:
            object.__setattr__(self, "shared", shared)  # used, not held: registered under the first layer only

    def forward(self, x):
        x = torch.tanh(self.lin(x))
        return self.shared(x) if hasattr(self, "shared") else x


class _SharedModel(torch.nn.Module):
    """Two layers, the second calling a module of the first's that it does not hold (Zamba2's shared block is held
    by one layer and used by several)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(11, 8)
        first = _Layer()
        self.blocks = torch.nn.ModuleList([first, _Layer(shared=first.lin)])

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x @ self.embed.weight.T


def test_a_module_used_by_a_layer_that_does_not_hold_it_is_converted_for_its_call():
    model = _SharedModel()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = copy.deepcopy(model).double()(ids)
        got = layerwise.Converted(model)(ids)
    assert got.dtype == torch.float64 and torch.equal(got, want)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
