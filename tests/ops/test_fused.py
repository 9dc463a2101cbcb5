"""The fused lowering (edgelin.ops.fused): ONNX Runtime's com.microsoft.LinearAttention node against edgelin's own
reading of it, and the forms under ``lowering("fused")`` against the naive float64 references.

1. The node as ONNX Runtime runs it (a one-node graph, float32) equals ``edgelin.ops.fused._reference`` (the
   operator's recurrence written out), for every update rule edgelin emits, decay per head and per feature,
   T = 1 and T > 1, batch 2, from a non-zero state: so the graphs compute what eager PyTorch computes. The same
   for the short convs' CausalConvWithState node (``_conv_reference``) and the Softplus node.
2. The fused path of every form (chunk and step; additive with and without the denominator, decayed per head or
   per feature, signed and positional maps; the delta rule plain and gated, beta up to 2) equals the naive
   float64 form within the forms' float64 contract, from a carried state, at T = 1, C - 1, C, C + 1 and 100.
"""

from __future__ import annotations

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from edgelin.ops import fused
from edgelin.ops import DELTA_FORMS, FORMS, naive_delta_rule, naive_linear_attention
from testkit.delta import BETAS, C, LENGTHS, RULES, reference, rel_err
from testkit.linear import PREFIX, TOLERANCE, feature_map, random_qkv

B, H = 2, 3
ADDITIVE_T = (1, C - 1, C, C + 1, 100)
MAPS = ("elu+1", "relu", "identity", "cosformer", "performer")
DECAYS = (None, "head", "feature")


# ---- 1. the node itself -------------------------------------------------------------------------------
def _node_graph(rule: str, per_feature: bool, dk: int, dv: int) -> bytes:
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, shape) for n, shape in (
        ("q", ["b", "t", H * dk]), ("k", ["b", "t", H * dk]), ("v", ["b", "t", H * dv]), ("past", ["b", H, dk, dv]))]
    names = ["q", "k", "v", "past"]
    if rule in ("gated", "gated_delta"):
        inputs.append(helper.make_tensor_value_info("decay", f, ["b", "t", H * dk if per_feature else H]))
        names.append("decay")
    if rule in ("delta", "gated_delta"):
        names += [""] * (5 - len(names)) + ["beta"]
        inputs.append(helper.make_tensor_value_info("beta", f, ["b", "t", H]))
    node = helper.make_node("LinearAttention", names, ["o", "S"], domain=fused.MS_DOMAIN, update_rule=rule,
                            q_num_heads=H, kv_num_heads=H, scale=1.0)
    outputs = [helper.make_tensor_value_info("o", f, None), helper.make_tensor_value_info("S", f, None)]
    model = helper.make_model(helper.make_graph([node], "one_node", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(fused.MS_DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize("T", [1, 19])
@pytest.mark.parametrize("rule,per_feature", [("linear", False), ("gated", False), ("gated", True), ("delta", False), ("gated_delta", False)],
                         ids=["linear", "gated-head", "gated-feature", "delta", "gated_delta"])
def test_onnx_runtime_runs_the_reference_recurrence(rule, per_feature, T):
    dk, dv = 8, 5  # d_k != d_v: a transposed state cannot pass
    gen = torch.Generator().manual_seed(T)
    q, k = (torch.randn(B, T, H * dk, generator=gen) for _ in range(2))
    if rule.endswith("delta"):  # the node expects unit keys for the delta rules
        k = torch.nn.functional.normalize(k.view(B, T, H, dk), dim=-1).view(B, T, H * dk)
    v = torch.randn(B, T, H * dv, generator=gen)
    past = torch.randn(B, H, dk, dv, generator=gen)
    feeds = {"q": q, "k": k, "v": v, "past": past}
    decay = beta = None
    if rule.startswith("gated"):
        decay = feeds["decay"] = -torch.rand(B, T, H * dk if per_feature else H, generator=gen) * 3
    if rule.endswith("delta"):
        beta = feeds["beta"] = 2 * torch.rand(B, T, H, generator=gen)
    session = ort.InferenceSession(_node_graph(rule, per_feature, dk, dv), providers=["CPUExecutionProvider"])
    o, S = session.run(None, {name: x.numpy() for name, x in feeds.items()})
    with torch.no_grad():
        ref_o, ref_S = fused._reference(*(x.double() for x in (q, k, v, past)), None if decay is None else decay.double(),
                                        None if beta is None else beta.double(), rule, H, 1.0)
    assert o.shape == tuple(ref_o.shape) and S.shape == tuple(ref_S.shape)
    assert rel_err(torch.from_numpy(o), ref_o) <= 2e-6, f"output: {rel_err(torch.from_numpy(o), ref_o):.3g}"
    assert rel_err(torch.from_numpy(S), ref_S) <= 2e-6, f"state: {rel_err(torch.from_numpy(S), ref_S):.3g}"


def _one_node(op: str, inputs: list[tuple[str, list]], outputs: list[str], domain: str = "", **attrs) -> bytes:
    f = TensorProto.FLOAT
    node = helper.make_node(op, [n for n, _ in inputs], outputs, domain=domain, **attrs)
    model = helper.make_model(helper.make_graph([node], "one_node", [helper.make_tensor_value_info(n, f, shape) for n, shape in inputs],
                                                [helper.make_tensor_value_info(n, f, None) for n in outputs]),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(fused.MS_DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


@pytest.mark.parametrize("T", [1, 3, 4, 5, 19])
@pytest.mark.parametrize("channels_last", [True, False], ids=["channels-last", "channels-first"])
@pytest.mark.parametrize("silu,bias", [(False, False), (True, True)], ids=["plain", "silu-bias"])
def test_onnx_runtime_runs_the_reference_conv(silu, bias, channels_last, T):
    """com.microsoft.CausalConvWithState against ``fused._conv_reference`` (the node as its specification states
    it), from a non-zero state, kernel 4 (the state holds 3 positions: T = 3, 4, 5 around it)."""
    Ch, K = 6, 4
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(*((B, T, Ch) if channels_last else (B, Ch, T)), generator=gen)
    past = torch.randn(*((B, K - 1, Ch) if channels_last else (B, Ch, K - 1)), generator=gen)
    weight, b = torch.randn(Ch, 1, K, generator=gen), torch.randn(Ch, generator=gen) if bias else None
    feeds = {"x": x, "w": weight, "past": past} | ({"b": b} if bias else {})
    names = [("x", list(x.shape)), ("w", list(weight.shape)), ("b" if bias else "", [Ch]), ("past", list(past.shape))]
    graph = _one_node("CausalConvWithState", [n for n in names if n[0]], ["y", "present"], fused.MS_DOMAIN,
                      channels_last=int(channels_last), activation="silu" if silu else "none")
    if not bias:  # the optional input left empty, as the exporter leaves it
        m = onnx.load_from_string(graph)
        m.graph.node[0].input[:] = ["x", "w", "", "past"]
        graph = m.SerializeToString()
    y, present = ort.InferenceSession(graph, providers=["CPUExecutionProvider"]).run(None, {n: t.numpy() for n, t in feeds.items()})
    with torch.no_grad():
        ref_y, ref_present = fused._conv_reference(x.double(), weight.double(), None if b is None else b.double(), past.double(),
                                                   channels_last, silu)
    assert y.shape == tuple(ref_y.shape) and present.shape == tuple(ref_present.shape) == tuple(past.shape)
    assert rel_err(torch.from_numpy(y), ref_y) <= 1e-6, f"output: {rel_err(torch.from_numpy(y), ref_y):.3g}"
    assert torch.equal(torch.from_numpy(present).double(), ref_present)  # positions moved, not computed


def test_onnx_runtimes_softplus_is_torchs_without_a_threshold():
    """The fused lowering writes softplus as one Softplus node; ONNX Runtime computes it without overflow and within
    float32 rounding of torch's (which returns x itself above 20) over the whole float range."""
    x = torch.cat([torch.linspace(-120, 120, 24001), torch.tensor([-1e30, -88.0, 19.999, 20.0, 20.001, 88.0, 89.0, 1e30])])
    (y,) = ort.InferenceSession(_one_node("Softplus", [("x", [None])], ["y"]), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})
    ref = torch.nn.functional.softplus(x.double())
    assert torch.isfinite(torch.from_numpy(y)).all()
    assert ((torch.from_numpy(y).double() - ref).abs() <= 2.5e-7 * ref.abs() + 1e-45).all()
    with fused.lowering("fused"):
        assert torch.equal(fused.softplus(x), torch.nn.functional.softplus(x))  # eager: torch's own


def test_the_lowering_is_scoped():
    assert not fused.active()
    with fused.lowering("fused"):
        assert fused.active()
        with fused.lowering("portable"):
            assert not fused.active()
        assert fused.active()
    assert not fused.active()
    with pytest.raises(ValueError, match="lowering must be one of portable, fused"):
        with fused.lowering("fast"):
            pass


# ---- 2. the forms' fused path against the naive references -------------------------------------------
def _decay(kind, T, F, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    shape = (B, H, T) if kind == "head" else (B, H, T, F)
    return torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 2)


@pytest.mark.parametrize("T", ADDITIVE_T, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("normalize", [True, False], ids=["den", "noden"])
@pytest.mark.parametrize("decay", DECAYS, ids=lambda d: f"decay-{d}")
@pytest.mark.parametrize("name", MAPS)
def test_additive_fused_matches_naive(name, decay, normalize, T):
    fm = feature_map(name)
    shift = 2.0 if fm.signed and normalize else 0.0  # a signed map's denominator kept away from zero, as tests/ops/test_forms.py does
    prefix = random_qkv(B, H, PREFIX, seed=1, shift=shift)
    _, initial = naive_linear_attention(*prefix, feature_map=fm, normalize=normalize, g=_decay(decay, PREFIX, fm.out_dim, 2))
    q, k, v = random_qkv(B, H, T, seed=3 + T, shift=shift)
    g = _decay(decay, T, fm.out_dim, 4 + T)
    ref_o, ref_state = naive_linear_attention(q, k, v, feature_map=fm, normalize=normalize, g=g, initial_state=initial)
    forms = ("chunk", "step") if T == 1 else ("chunk",)
    for form in forms:
        with fused.lowering("fused"):
            o, state = FORMS[form](q, k, v, feature_map=fm, normalize=normalize, g=g, initial_state=initial, chunk_size=C)
        assert set(state) == set(ref_state)
        assert rel_err(o, ref_o) <= TOLERANCE[torch.float64], f"{form} o: {rel_err(o, ref_o):.3g}"
        for key in ref_state:
            if ref_state[key].is_floating_point():
                assert rel_err(state[key], ref_state[key]) <= TOLERANCE[torch.float64], f"{form} {key}: {rel_err(state[key], ref_state[key]):.3g}"
            else:
                assert torch.equal(state[key], ref_state[key]), f"{form} {key}"


@pytest.mark.parametrize("T", LENGTHS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("betas", BETAS)
@pytest.mark.parametrize("rule", RULES)
def test_delta_fused_matches_naive(rule, betas, T):
    (q, k, v, beta, g), initial, ref_o, ref_state = reference(T, rule, betas)
    forms = ("chunk", "step") if T == 1 else ("chunk",)
    for form in forms:
        with fused.lowering("fused"):
            o, state = DELTA_FORMS[form](q, k, v, beta, g=g, initial_state=initial, chunk_size=C)
        assert set(state) == {"S"}
        assert rel_err(o, ref_o) <= 1e-12, f"{form} o: {rel_err(o, ref_o):.3g}"
        assert rel_err(state["S"], ref_state["S"]) <= 1e-12, f"{form} S: {rel_err(state['S'], ref_state['S']):.3g}"


def test_delta_fused_scales_and_normalises_as_the_forms_do():
    """scale and qk_l2norm are applied before the node (its own scale is 1): un-normalised inputs, scale 0.3."""
    (q, k, v, beta, g), initial, _, _ = reference(C + 1, "gated", "uniform")
    q, k = q * 3, k * 0.5
    ref_o, ref_state = naive_delta_rule(q, k, v, beta, g=g, initial_state=initial, scale=0.3, qk_l2norm=True)
    with fused.lowering("fused"):
        o, state = DELTA_FORMS["chunk"](q, k, v, beta, g=g, initial_state=initial, chunk_size=C, scale=0.3, qk_l2norm=True)
    assert rel_err(o, ref_o) <= 1e-12 and rel_err(state["S"], ref_state["S"]) <= 1e-12


def test_a_ragged_batch_stays_portable():
    """Per-row lengths cannot be said to the node: the chunk form runs its portable code (no custom op)."""
    fm = feature_map("elu+1")
    q, k, v = random_qkv(B, H, C + 3, seed=5)
    lengths = torch.tensor([C + 3, 4])
    ref = FORMS["chunk"](q, k, v, feature_map=fm, chunk_size=C, lengths=lengths)
    with fused.lowering("fused"):
        got = FORMS["chunk"](q, k, v, feature_map=fm, chunk_size=C, lengths=lengths)
    assert torch.equal(got[0], ref[0]) and all(torch.equal(got[1][n], ref[1][n]) for n in ref[1])


def test_the_schema_is_declared_once():
    """Declaring the contrib operators' schemas twice (two exports in one process) is not an error."""
    fused._schema()
    fused._schema()
    assert onnx.defs.has("LinearAttention", fused.MS_DOMAIN) and onnx.defs.has("CausalConvWithState", fused.MS_DOMAIN)


def test_the_exporter_imports_after_the_schema_is_declared():
    """In a fresh process the schemas declared first (validate or a checker before any export), then onnxscript imported:
    onnx's reference evaluator refuses a name in two domains (LinearAttention and RotaryEmbedding are also standard ONNX
    operators) if it is first imported after the declarations."""
    import subprocess
    import sys

    code = "from edgelin.ops import fused; fused._schema(); import onnxscript; fused.translation_table(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-500:]
