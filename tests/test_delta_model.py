"""LinearLM with the delta rule (config ``update = "delta"``): DeltaNet (decay "none") and Gated DeltaNet (decay
"scalar", "fixed"). The model's forms against each other in float64 (chunk, recurrent and step against the naive
loop), ragged prefill, the config's refusals, and one export through the project's exporter, run in ONNX Runtime
against PyTorch (prefill at awkward lengths, decode with the state fed back)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edgelin.config import ModelConfig
from edgelin.errors import ConfigError
from edgelin.model import LinearLM

C = 16


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def model(decay: str = "scalar", feature_map: str = "identity", n_layers: int = 2, seed: int = 0) -> LinearLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=256, d_model=32, n_layers=n_layers, n_heads=2, head_dim=16, chunk_size=C, feature_map=feature_map,
        normalisation="none", conv_size=4, decay=decay, update="delta",
    )
    m = LinearLM(cfg).eval()
    with torch.no_grad():  # sharper weights than init, so the layers do something
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return m


def ids(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("feature_map", ["identity", "elu+1"])
@pytest.mark.parametrize("decay", ["none", "scalar", "fixed"])
@torch.no_grad()
def test_forms_agree_in_float64(decay, feature_map):
    """From a carried state (a 7-token prefix), chunk and recurrent against the naive loop, and the step form
    token by token against the chunked prefill."""
    m = model(decay, feature_map).double()
    _, state = m(ids(2, 7, seed=1), form="naive")
    x = ids(2, 2 * C + 3)
    ref, ref_state = m(x, state, form="naive")
    for form in ("chunk", "recurrent"):
        got, got_state = m(x, state, form=form)
        assert rel_err(got, ref) <= 1e-11, form
        assert all(rel_err(got_state[k], ref_state[k]) <= 1e-11 for k in ref_state), form
    s, steps = state, []
    for t in range(x.shape[1]):
        logits, s = m.step(x[:, t : t + 1], s)
        steps.append(logits)
    assert rel_err(torch.cat(steps, dim=1), ref) <= 1e-11
    assert set(ref_state) == {f"{i}.{n}" for i in range(2) for n in ("S", "conv")}
    assert ref_state["0.S"].shape == (2, 2, 16, 16)


@torch.no_grad()
def test_ragged_prefill_is_each_row_alone():
    m = model("scalar").double()
    x = ids(3, 2 * C + 3, seed=4)
    lengths = torch.tensor([2 * C + 3, C + 1, 1])
    logits, state = m(x, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        alone, alone_state = m(x[b : b + 1, :n])
        assert rel_err(logits[b : b + 1, :n], alone) <= 1e-11
        assert all(rel_err(state[k][b : b + 1], alone_state[k]) <= 1e-11 for k in state)


def test_delta_rule_changes_the_model():
    """The same weights with the additive update give other logits (the option is not a no-op)."""
    m = model("scalar")
    plain = LinearLM(m.cfg.replace(update="additive"))
    plain.load_state_dict({k: t for k, t in m.state_dict().items() if "beta_proj" not in k})
    with torch.no_grad():
        assert rel_err(plain(ids(2, 20))[0], m(ids(2, 20))[0]) > 1e-3
    assert "blocks.0.attn.beta_proj.weight" in m.state_dict() and "blocks.0.attn.beta_proj.weight" not in plain.state_dict()


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"normalisation": "denominator"}, "normalisation"),
        ({"decay": "gla"}, "decay"),
        ({"feature_map": "cosformer"}, "feature_map"),
        ({"update": "hebbian"}, "update"),
    ],
)
def test_config_refusals_name_the_field(changes, field):
    base = {"normalisation": "none", "update": "delta"}
    with pytest.raises(ConfigError, match=f"'{field}'"):
        ModelConfig(**(base | changes))


def test_a_config_without_the_field_is_additive():
    data = ModelConfig(d_model=64).to_dict()
    del data["update"]
    assert ModelConfig.from_dict(data).update == "additive"


def test_parallel_form_is_refused():
    with pytest.raises(ValueError, match="update 'delta'"):
        model("none", n_layers=1)(ids(1, 5), form="parallel")


# ---- through the exported graphs ------------------------------------------------------------------------

GRAPH_LEVELS = 4  # the prefill scan's levels at the export's bound: a faster export than at the default 4,096 tokens
MAX_SEQUENCE = C << GRAPH_LEVELS  # 2^4 chunks = 256 tokens per prefill call


@pytest.fixture(scope="module")
def exported_delta(export_cache):
    pytest.importorskip("onnxscript")
    from edgelin.exporters import export

    m = model("scalar", "identity", n_layers=2, seed=3).float()

    def build(out):
        export(m, out, max_sequence=MAX_SEQUENCE)  # with its own smoke check of both graphs

    return m, export_cache.get("delta-lm", {"model": ["scalar", "identity", 2, 3], "max_sequence": MAX_SEQUENCE}, build)


def sessions(out):
    import onnxruntime as ort

    from edgelin.runtime.manifest import Manifest

    manifest = Manifest.load(out)
    return manifest, {g: ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for g, f in manifest.graphs.items()}


def run(manifest, session, x, state):
    x = np.asarray(x, np.int64)
    prefill = manifest.logits_at in [i.name for i in session.get_inputs()]
    at = manifest.prefill_positions(*x.shape) if prefill else {}  # every position's logits
    feeds = {manifest.input_ids: x} | at | {s.input: state[s.key] for s in manifest.states}
    got = session.run(None, feeds)
    return got[0], {s.key: v for s, v in zip(manifest.states, got[1:])}


@pytest.mark.slow  # one export of a 2-layer model: ~100 s on a loaded 2-core machine
@torch.no_grad()
def test_exported_graphs_match_torch(exported_delta):
    m, out = exported_delta
    manifest, graphs = sessions(out)
    assert not {"Loop", "Scan", "If"} & {node.op_type for g in graphs for node in _onnx(out, manifest, g).graph.node}
    fresh = {s.key: t.numpy() for s, t in zip(manifest.states, m.init_state(2).values())}
    for T in (1, C - 1, C, C + 1, C * (1 << GRAPH_LEVELS)):
        x = ids(2, T, seed=T)
        ref, ref_state = m(x)
        logits, state = run(manifest, graphs["prefill"], x.numpy(), fresh)
        assert rel_err(logits, ref) <= 1e-5, T
        assert all(rel_err(state[k], ref_state[k]) <= 1e-5 for k in ref_state), T
    # decode 20 tokens after a prefill, the state fed back each step
    s_graph, s_torch = state, ref_state
    for t, token in enumerate(ids(2, 20, seed=99).T):
        logits, s_graph = run(manifest, graphs["decode"], token[:, None].numpy(), s_graph)
        ref, s_torch = m.step(token[:, None], s_torch)
        assert rel_err(logits, ref) <= 1e-5, t
    assert all(rel_err(s_graph[k], s_torch[k]) <= 1e-5 for k in s_torch)


@pytest.mark.slow  # the export above, shared
@torch.no_grad()
def test_a_prefill_call_is_bounded_and_the_runtime_keeps_to_the_bound(exported_delta):
    """The manifest records the export's max_sequence; the prefill graph is exact up to it (above) and NaN one token
    past it (never silently wrong); the runtime cuts a longer prompt, even one asked for in one call, into pieces
    within the bound, and gives PyTorch's logits and state."""
    from edgelin.runtime import Session

    m, out = exported_delta
    manifest, graphs = sessions(out)
    assert manifest.max_sequence == MAX_SEQUENCE
    fresh = {s.key: t.numpy() for s, t in zip(manifest.states, m.init_state(2).values())}
    logits, state = run(manifest, graphs["prefill"], ids(2, MAX_SEQUENCE + 1).numpy(), fresh)
    assert np.isnan(logits).all()
    scanned = [k for k in state if k.endswith(".S")]  # the delta rule's states (a conv window holds only its inputs)
    assert len(scanned) == 2 and all(np.isnan(state[k]).all() for k in scanned)
    x = ids(2, 2 * MAX_SEQUENCE + 37, seed=5)
    ref, ref_state = m(x)
    session = Session(out)
    got_state = session.new_state(2)
    got = session.prefill(x.numpy(), got_state, chunk=x.shape[1])
    got_state = got_state.numpy()
    assert rel_err(got, ref) <= 1e-5
    assert all(rel_err(got_state[f"state.{k}"], ref_state[k]) <= 1e-5 for k in ref_state)
    assert session._pieces(x.shape[1], None) == [(0, 256), (256, 512), (512, 549)]  # the manifest's piece (1,024) capped


def _onnx(out, manifest, graph):
    import onnx

    return onnx.load(str(out / manifest.graphs[graph]))
