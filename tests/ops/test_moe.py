"""The mixture-of-experts MLP (edgelin.layers.moe, edgelin.ops.moe) against its naive loops over tokens and their
chosen experts, in float64: softmax and sigmoid scoring, a score-correction bias, renormalisation with and without
an epsilon, a routed scaling factor, k = 1 and k = E, a shared expert with and without its gate, exact ties; and the
ONNX lowering of the experts (NonZero / GatherND / MatMul / ScatterND) in ONNX Runtime at T = 1 (most experts get
no row), batch > 1 and a longer prompt."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from edgelin.layers.moe import MoE, MoEMixer, MoEOptions
from edgelin.ops.moe import route, translation_table
from testkit import max_abs

D, I = 16, 8
CASES = {
    "softmax-renorm": dict(num_experts=6, top_k=2, scoring="softmax"),
    "sigmoid-bias-eps-scale": dict(num_experts=6, top_k=3, scoring="sigmoid", score_bias=True, renormalise_eps=1e-6, scaling=2.5),
    "sigmoid-no-renorm": dict(num_experts=5, top_k=2, scoring="sigmoid", renormalise=False),
    "k1": dict(num_experts=4, top_k=1, scoring="softmax"),
    "k-equals-e": dict(num_experts=4, top_k=4, scoring="softmax", renormalise=False),
    "shared-gated": dict(num_experts=4, top_k=2, scoring="softmax", shared_hidden=12, shared_gate=True),
    "shared-ungated": dict(num_experts=4, top_k=2, scoring="sigmoid", score_bias=True, shared_hidden=12),
    # Granite-4.0-H's: top-k of the logits, softmax over the chosen; its shared expert with gate and up rows packed
    "topk-softmax-packed-shared": dict(num_experts=6, top_k=2, scoring="topk_softmax", shared_hidden=12,
                                       shared_kind="packed_swiglu"),
    # Nemotron-H's: relu^2 experts without a gate inside latent projections, sigmoid scores with a correction bias,
    # 2 of 4 groups, renormalised (+1e-20), scaled; a relu^2 shared expert
    "relu2-latent-groups": dict(num_experts=8, top_k=3, scoring="sigmoid", score_bias=True, renormalise_eps=1e-20, scaling=2.5,
                                expert_kind="relu2", shared_kind="relu2", shared_hidden=12, latent=6, groups=4, top_groups=2),
    "groups-softmax": dict(num_experts=6, top_k=3, scoring="softmax", groups=3, top_groups=2),
}


def make(seed: int = 0, **options) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(MoEOptions(d_model=D, expert_hidden=I, **options)).double().eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        if moe.expert_bias is not None:
            moe.expert_bias.normal_(0, 0.5)
    return moe


@pytest.mark.parametrize("case", list(CASES))
def test_moe_matches_the_naive_loops_in_float64(case):
    moe = make(**CASES[case])
    x = torch.randn(3, 37, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ids, w = moe.routing(x)
        nids, nw = moe.routing(x, naive=True)
        assert torch.equal(ids, nids) and max_abs(w, nw) <= 1e-15
        got, ref = moe(x), moe(x, naive=True)
        moe.call_modules = True  # the experts as modules on their routed rows (edgelin.quantref's path)
        modules = moe(x)
    assert got.shape == x.shape and got.abs().max() > 0.1
    assert max_abs(got, ref) <= 1e-13 and max_abs(modules, ref) <= 1e-13


def test_routing_rules():
    """Scores, the biased choice, renormalisation and scaling as transformers' routers compute them."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    ids, w = route(logits, 2, scoring="softmax", renormalise=True)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, p[[0, 1]] / p[[0, 1]].sum())
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)  # chooses expert 2 first; its weight stays unbiased
    ids, w = route(logits, 2, scoring="sigmoid", bias=bias, renormalise=True, eps=1e-6, scale=2.0)
    s = torch.sigmoid(logits)[0]
    assert ids.tolist() == [[2, 0]] and torch.allclose(w, 2.0 * s[[2, 0]] / (s[[2, 0]].sum() + 1e-6))


def test_ties_choose_a_valid_top_k():
    """Equal scores: torch.topk (PyTorch, and transformers, which calls it) may choose any of the tied experts (it
    chose index 2 of five equal scores here); every choice is a top k, and the weights are those of the choice. The
    graphs' TopK chooses the lower index (test_onnx_lowering_runs_only_routed_rows[ties])."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)
    for k in (1, 2, 3):
        ids, w = route(logits, k, scoring="softmax", renormalise=True)
        scores = torch.softmax(logits, -1)
        chosen = torch.gather(scores, 1, ids)
        others = scores.masked_fill(torch.zeros_like(scores, dtype=torch.bool).scatter(1, ids, True), -1.0)
        assert (chosen.min(-1).values >= others.max(-1).values).all() and all(len(set(r.tolist())) == k for r in ids)
        assert torch.allclose(w, chosen / chosen.sum(-1, keepdim=True))


def test_topk_softmax_is_softmax_then_renormalise():
    """Granite's rule (softmax over the k largest logits) chooses and weighs as softmax over all, top k, renormalised."""
    logits = torch.randn(50, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ids, w = route(logits, 3, scoring="topk_softmax")
    ids2, w2 = route(logits, 3, scoring="softmax", renormalise=True)
    assert torch.equal(ids, ids2) and max_abs(w, w2) <= 1e-15


def test_group_limited_routing_and_its_near_ties():
    """Group-limited routing (Nemotron-H's) against the naive loop: groups scored by their two best choice scores;
    crafted rows where a group beats another by 1e-12 (the better one is kept), where two groups tie exactly (the lower
    index is kept, as ONNX TopK keeps it), and where the single best expert sits in a group that loses (it is not
    chosen)."""
    from edgelin.ops.moe import naive_route, top_mask

    g = torch.Generator().manual_seed(4)
    x = torch.randn(200, 8, dtype=torch.float64, generator=g)
    bias = torch.randn(8, dtype=torch.float64, generator=g) * 0.3
    for k, top_groups in ((1, 1), (2, 1), (3, 2), (4, 3)):
        rule = dict(scoring="sigmoid", bias=bias, renormalise=True, eps=1e-20, scale=2.0, groups=4, top_groups=top_groups)
        (ids, w), (nids, nw) = route(x, k, **rule), naive_route(x, k, **rule)
        assert torch.equal(ids.sort(-1).values, nids.sort(-1).values)
        assert max_abs(w.gather(1, ids.argsort(-1)), nw.gather(1, nids.argsort(-1))) <= 1e-15
    logit = lambda p: torch.log(torch.tensor(p, dtype=torch.float64) / (1 - torch.tensor(p, dtype=torch.float64)))  # noqa: E731
    rows = logit([
        [0.5, 0.4, 0.45, 0.45 - 1e-12, 0.1, 0.1, 0.1, 0.1],  # group 0 (0.9) beats group 1 (0.9 - 1e-12)
        [0.1, 0.1, 0.5, 0.4, 0.1, 0.1, 0.45, 0.45],  # groups 1 and 3 tie exactly: group 1 kept
        [0.95, 0.01, 0.6, 0.6, 0.1, 0.1, 0.2, 0.2],  # best expert 0, but group 1 (1.2) beats group 0 (0.96)
    ])
    ids, _ = route(rows, 2, scoring="sigmoid", renormalise=True, groups=4, top_groups=1)
    nids, _ = naive_route(rows, 2, scoring="sigmoid", renormalise=True, groups=4, top_groups=1)
    assert [sorted(r) for r in ids.tolist()] == [[0, 1], [2, 3], [2, 3]] == [sorted(r) for r in nids.tolist()]
    mask = top_mask(torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]]), 2)
    assert mask.tolist() == [[False, True, True, False, False]]  # a tie to the lower index


def test_moe_mixer_has_no_state_and_runs_any_form():
    layer = MoEMixer(make(**CASES["k1"]))
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with torch.no_grad():
        y, state = layer(x, {}, form="chunk")
        y_naive, _ = layer(x, {}, form="naive")
    assert state == {} and layer.state_layout() == {} and layer.forms is None
    assert max_abs(y, y_naive) <= 1e-13


@pytest.mark.parametrize("case", ["sigmoid-bias-eps-scale", "shared-gated", "ties"])
def test_onnx_lowering_runs_only_routed_rows(case, tmp_path):
    """The exported MoE in ONNX Runtime (CPU) at T = 1, batch 1 and 2, and T = 70: the torch operator per expert
    became NonZero / GatherND / three MatMuls on the expert's constant [in, out] weights / ScatterND of out[rows] + y.
    "ties": experts 1 and 3 score the same for every token; the graph's TopK takes the lower, as the naive rule."""
    import onnx
    import onnxruntime as ort

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    moe = make(**CASES["sigmoid-bias-eps-scale" if case == "ties" else case])
    if case == "ties":
        with torch.no_grad():
            moe.router.weight[3], moe.expert_bias[3] = moe.router.weight[1], moe.expert_bias[1]
    reference = moe.double() if case == "ties" else None
    moe = moe.float() if reference is None else MoE(moe.options).eval()
    if reference is not None:
        moe.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    x = torch.randn(2, 5, D)
    B, T = torch.export.Dim("B"), torch.export.Dim("T")
    path = tmp_path / "moe.onnx"
    torch.onnx.export(moe, (x,), input_names=["x"], output_names=["y"], dynamic_shapes=({0: B, 1: T},), dynamo=True,
                      opset_version=18, optimize=True, custom_translation_table=translation_table()).save(str(path))
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    E = moe.options.num_experts
    assert ops.count("NonZero") == E and ops.count("ScatterND") == E and ops.count("TopK") == 1
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    matmuls = [n for n in graph.node if n.op_type == "MatMul" and shapes.get(n.input[1]) in ((D, I), (I, D))]
    assert len(matmuls) == 3 * E  # every expert's gate, up and down on its own constant weights
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((1, 1, D), (2, 1, D), (2, 70, D)):
        xx = torch.randn(*shape)
        with torch.no_grad():
            want = moe(xx).numpy() if reference is None else reference(xx.double(), naive=True).float().numpy()
        got = session.run(None, {"x": xx.numpy()})[0]
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), shape


def test_fp16_keeps_each_router_in_fp32(tmp_path):
    """The fp16 conversion keeps each router, from its MatMul to its TopK, in fp32 (exporters.precision.fp16's
    router_region): fp16 router logits flipped near ties between experts on a tiny LFM2-MoE (validate's routing
    agreement 99.75 % -> 99.88 %). The converted graph runs in ONNX Runtime, empty expert rows included."""
    import onnx
    import onnxruntime as ort

    from edgelin.exporters.precision.fp16 import convert_fp16, router_region

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    moe = make(**CASES["sigmoid-bias-eps-scale"]).float()
    B, T = torch.export.Dim("B"), torch.export.Dim("T")
    path = tmp_path / "moe.onnx"
    torch.onnx.export(moe, (torch.randn(2, 5, D),), input_names=["x"], output_names=["y"], dynamic_shapes=({0: B, 1: T},),
                      dynamo=True, opset_version=18, optimize=True, custom_translation_table=translation_table()).save(str(path))
    proto = onnx.load(str(path))
    region = router_region(proto.graph)
    kinds = sorted(n.op_type for n in proto.graph.node if n.name in region and n.op_type in ("MatMul", "TopK", "Sigmoid", "Add"))
    assert kinds == ["Add", "MatMul", "Sigmoid", "TopK"], kinds  # the router's MatMul, its scores, the bias, the choice
    converted, note = convert_fp16(proto, "float32")
    assert any("routers" in k for k in note.kept)
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(1, 1, D)
    with torch.no_grad():
        want = moe(x).numpy()
    got = session.run(None, {"x": x.numpy().astype(np.float16)})[0]  # a graph input the conversion makes fp16
    assert np.abs(got.astype(np.float32) - want).max() <= 8e-3 * max(1.0, np.abs(want).max())


def test_onnx_lowering_of_relu2_latent_grouped_experts(tmp_path):
    """Nemotron-H's MoE exported: one TopK per layer (the groups ranked by comparisons), per expert NonZero /
    GatherND / two MatMuls on its constant [latent, I] / [I, latent] weights / ScatterND; in ONNX Runtime at T = 1,
    batch 2 and T = 70 against the naive loops in float64, experts 1 and 3 tied (the lower one taken)."""
    import onnx
    import onnxruntime as ort

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    reference = make(**CASES["relu2-latent-groups"])
    with torch.no_grad():
        reference.router.weight[3], reference.expert_bias[3] = reference.router.weight[1], reference.expert_bias[1]
    moe = MoE(reference.options).eval()
    moe.load_state_dict({k: v.float() for k, v in reference.state_dict().items()})
    B, T = torch.export.Dim("B"), torch.export.Dim("T")
    path = tmp_path / "moe.onnx"
    torch.onnx.export(moe, (torch.randn(2, 5, D),), input_names=["x"], output_names=["y"], dynamic_shapes=({0: B, 1: T},),
                      dynamo=True, opset_version=18, optimize=True, custom_translation_table=translation_table()).save(str(path))
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    E, L = moe.options.num_experts, moe.options.latent
    assert ops.count("NonZero") == E and ops.count("ScatterND") == E and ops.count("TopK") == 1
    shapes = {t.name: tuple(t.dims) for t in graph.initializer}
    assert len([n for n in graph.node if n.op_type == "MatMul" and shapes.get(n.input[1]) in ((L, I), (I, L))]) == 2 * E
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for shape in ((1, 1, D), (2, 1, D), (2, 70, D)):
        xx = torch.randn(*shape)
        with torch.no_grad():
            want = reference(xx.double(), naive=True).float().numpy()
        got = session.run(None, {"x": xx.numpy()})[0]
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), shape
