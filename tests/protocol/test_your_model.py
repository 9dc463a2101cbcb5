"""The model protocol, end to end, on a model that edgelin does not know: it is defined here, outside the
package, with its own feature map and one extra kind of state (an absolute position for a learned
position embedding). Export -> validate -> generate must work with no edgelin base class.
docs/your-model.md walks through the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgelin.errors import ExportError
from edgelin.exporters import export
from edgelin.layers.feature_maps import FeatureMap
from edgelin.ops import FORMS
from edgelin.protocol import ExportableModel
from edgelin.runtime import Generator, load
from edgelin.runtime.manifest import StateSpec
from edgelin.state import fresh_state
from edgelin.validate import validate


class SoftplusSquared(FeatureMap):
    """phi(x) = softplus(x)^2 > 0: a map edgelin does not ship."""

    def forward(self, x, *, is_query, positions=None):
        return F.softplus(x) ** 2


class PositionalLinearLM(nn.Module):
    """Embedding + a learned absolute position embedding -> n x linear attention -> head.
    State: "pos" [batch] int64 (tokens seen), and per layer S, z of the attention."""

    vocab_size = 256
    chunk_size = 16

    def __init__(self, d_model: int = 32, n_heads: int = 2, n_layers: int = 2, max_positions: int = 4096) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.n_layers, self.max_positions = d_model, n_heads, n_layers, max_positions
        self.head_dim = d_model // n_heads
        self.embed = nn.Embedding(self.vocab_size, d_model)
        self.pos_embed = nn.Embedding(max_positions, d_model)
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model, bias=False) for _ in range(n_layers))
        self.out = nn.ModuleList(nn.Linear(d_model, d_model, bias=False) for _ in range(n_layers))
        self.head = nn.Linear(d_model, self.vocab_size, bias=False)
        self.phi = SoftplusSquared(self.head_dim)

    # ---- the protocol ----
    def state_specs(self) -> tuple[StateSpec, ...]:
        H, D = self.n_heads, self.head_dim
        specs = [StateSpec.for_key("pos", ("batch",), "int64", 0)]
        for i in range(self.n_layers):
            specs.append(StateSpec.for_key(f"{i}.S", ("batch", H, D, D)))
            specs.append(StateSpec.for_key(f"{i}.z", ("batch", H, D)))
        return tuple(specs)

    def model_config(self) -> dict:
        return {"family": "example/positional-linear", "d_model": self.d_model, "n_heads": self.n_heads,
                "n_layers": self.n_layers, "max_positions": self.max_positions}

    def forward(self, input_ids, state=None, *, form: str = "chunk"):
        B, T = input_ids.shape
        if state is None:
            state = fresh_state(self.state_specs(), B, dtype=self.embed.weight.dtype)
        positions = state["pos"][:, None] + torch.arange(T, device=input_ids.device)[None, :]  # [B, T]
        x = self.embed(input_ids) + self.pos_embed(positions.clamp(max=self.max_positions - 1))  # [B, T, d]
        new = {"pos": state["pos"] + T}
        for i in range(self.n_layers):
            q, k, v = (t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2) for t in self.qkv[i](x).chunk(3, -1))  # [B, H, T, Dh]
            o, st = FORMS[form](q, k, v, feature_map=self.phi, initial_state={"S": state[f"{i}.S"], "z": state[f"{i}.z"]},
                                chunk_size=self.chunk_size)
            x = x + self.out[i](o.transpose(1, 2).reshape(B, T, self.d_model))  # [B, T, d]
            new[f"{i}.S"], new[f"{i}.z"] = st["S"], st["z"]
        return self.head(x), new

    def step(self, input_ids, state):
        return self.forward(input_ids, state, form="step")


@pytest.fixture(scope="module")
def outside(export_of):
    torch.manual_seed(0)
    model = PositionalLinearLM().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # logits with spread (std ~2, max ~13): greedy streams vary
    return model, export_of(model, {"positional_linear_lm": "seed 0, x1.5"}, label="outside")


def test_it_is_a_protocol_model_without_a_base_class(outside):
    model, _ = outside
    assert isinstance(model, ExportableModel)
    assert not any(c.__module__.startswith("edgelin") for c in type(model).__mro__ if c not in (nn.Module, object))


def test_manifest_carries_its_state_contract_and_config(outside):
    model, out = outside
    session = load(out, provider="cpu")
    m = session.manifest
    assert [s.key for s in m.states] == [s.key for s in model.state_specs()]
    assert m.states[0].input == "state.pos" and m.states[0].dtype == "int64"
    assert m.model["family"] == "example/positional-linear" and m.extra["chunk_size"] == 16


def test_validate_passes(outside):
    model, out = outside
    report = validate(out, model, steps=16, long=200)
    assert report.passed, report.table()
    groups = {c.group for c in report.checks}
    assert {"structure", "prefill", "decode", "graphs", "long", "behaviour"} <= groups


def test_generate_matches_pytorch_greedy(outside):
    model, out = outside
    session = load(out, provider="cpu")
    prompt = list(b"positions live in the state")
    got = [t.id for t in Generator(session, [prompt], max_new_tokens=24)]
    want = []
    with torch.no_grad():
        logits, state = model(torch.tensor([prompt]))
        for _ in range(24):
            tok = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            want.append(int(tok))
            logits, state = model.step(tok, state)
    assert got == want
    assert int(np.asarray(session.new_state(1).numpy()["state.pos"])[0]) == 0


def test_a_model_torch_cannot_trace_is_refused_with_the_reason(tmp_path):
    """A data-dependent branch torch.export cannot trace: the one-line error gives torch's reason (it gave only
    torch.onnx's "Failed to export ... This is step 1/3" with terminal colour codes), and nothing is written."""

    class Branching(PositionalLinearLM):
        def forward(self, ids, state=None, **kwargs):
            if ids.sum() > 10:  # on the ids' values: not traceable
                ids = ids + 0
            return super().forward(ids, state, **kwargs)

    torch.manual_seed(0)
    with pytest.raises(ExportError) as info:
        export(Branching().eval(), tmp_path / "out", check=False)
    message = str(info.value)
    assert "\n" not in message and "\x1b" not in message, message
    assert "data-dependent" in message and message.endswith("nothing was written"), message
    assert not (tmp_path / "out").exists()


def test_a_module_without_the_protocol_is_refused_by_name(tmp_path):
    class Half(nn.Module):
        vocab_size = 256

        def forward(self, ids, state=None):
            return ids, state

    with pytest.raises(ExportError, match="lacks step, state_specs, model_config"):
        export(Half(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
