"""edgelin.quantref: PyTorch computing an int8 / int4 export's own quantisation, the reference validate holds the
export's states to.

The rounding helpers are held to ONNX Runtime's operators and to the numpy statement of MatMulNBits; the quantised
nn.Linear of each arithmetic (int8 block, int8 channel, int4) to the exporter's own rewrite of a MatMul run by ONNX
Runtime, at awkward K; a transformers Gated DeltaNet hybrid's int8 export (the block scheme, its default) to
validate, whose states pass against the quantised reference where fp32's are out of int8's state bound, and to a
broken scale, which the reference catches while the logits stay within int8's budget.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from edgelin import quantref
from edgelin.exporters.precision import convert
from edgelin.parity import BUDGETS
from testkit import rel_l2
from testkit.quant import int8_blocks

ARITHMETICS = {  # id -> (precision, int8 scheme, the ONNX Runtime operator the exporter writes)
    "int8-block": ("int8", "block", "MatMulNBits"),
    "int8-channel": ("int8", "channel", "MatMulInteger"),
    "int4": ("int4", None, "MatMulNBits"),
}


def _manifest(precision: str, scheme: str | None = None, embedding: str | None = "int8"):
    extra = {} if embedding is None else {"embedding": embedding}
    if scheme is not None:
        extra["int8_scheme"] = scheme
    return SimpleNamespace(precision=precision, extra=extra)


def _run(proto: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("K", [32, 64, 33, 1, 101])
def test_block_rounding_is_matmulnbits_rounding(K):
    """Whole blocks: the numpy statement of MatMulNBits' activations (testkit.quant); a part block: as if zero-padded."""
    x = (np.random.default_rng(K).standard_normal((3, 5, K)) * 4).astype(np.float32)
    got = quantref.round_blocks(torch.from_numpy(x)).numpy()
    pad = (-K) % 32
    ref = int8_blocks(np.pad(x, ((0, 0), (0, 0), (0, pad))))[..., :K]
    np.testing.assert_allclose(got, ref, rtol=0, atol=np.abs(x).max() * 1e-6)
    assert rel_l2(got, x) > 1e-4 or K == 1  # it does round (a block of one value is its own step x 127)


def test_tensor_rounding_is_dynamicquantizelinear():
    """One uint8 scale and zero point per tensor, as ONNX Runtime's DynamicQuantizeLinear -> DequantizeLinear gives."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]), helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "dq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, None])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(0)
    for x in (rng.standard_normal((7, 33)) * 3, np.abs(rng.standard_normal((4, 9))), -np.abs(rng.standard_normal((4, 9))) - 1, np.zeros((2, 3))):
        x = x.astype(np.float32)
        ref = _run(proto, x)
        got = quantref.round_tensor(torch.from_numpy(x)).numpy()
        step = (max(x.max(), 0) - min(x.min(), 0)) / 255
        assert np.abs(got - ref).max() <= step * 1e-4 + 1e-7, (np.abs(got - ref).max(), step)


@pytest.mark.parametrize("arith", ARITHMETICS)
@pytest.mark.parametrize(("K", "N", "T"), [(64, 24, 1), (40, 24, 5), (101, 17, 7)])
def test_a_quantised_linear_computes_what_the_exported_matmul_computes(arith, K, N, T):
    """x @ W rewritten by the exporter (convert) and run by ONNX Runtime == nn.Linear(W) through quantised_model, within
    fp32 accumulation order; and far from the fp32 product (what the quantisation itself moves)."""
    precision, scheme, op = ARITHMETICS[arith]
    rng = np.random.default_rng(K * N + T)
    W = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "mm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "T", N])], [numpy_helper.from_array(W, "W")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    out, _ = convert(proto, precision, int8_scheme=scheme)
    assert op in {n.op_type for n in out.graph.node}
    x = (rng.standard_normal((2, T, K)) * 2).astype(np.float32)
    ref = _run(out, x)
    linear = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.from_numpy(W.T))
    model = quantref.quantised_model(torch.nn.Sequential(linear), _manifest(precision, scheme))
    with torch.no_grad():
        got = model(torch.from_numpy(x)).numpy()
    assert rel_l2(got, ref) <= 1e-5, rel_l2(got, ref)
    assert rel_l2(x @ W, ref) > 100 * max(rel_l2(got, ref), 1e-7)


class _Head(torch.nn.Module):
    """x -> body -> untied head: the shape of a model's last two products."""

    def __init__(self, K: int, N: int) -> None:
        super().__init__()
        self.body = torch.nn.Linear(K, K, bias=False)
        self.lm_head = torch.nn.Linear(K, N, bias=False)

    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.parametrize(("embedding", "head_bits"), [("int8", 8), ("int4", 4), ("fp32", None)])
def test_an_int4_exports_untied_head_is_stored_as_the_table(embedding, head_bits):
    """int4: the MatMul computing the logits gets the embedding's storage (8 bits by default; exporters/precision.py:
    _quantise_untied_head says why), the other products 4 bits; the notes say where the head stays fp32; the graph
    computes what quantref's model computes."""
    K, N = 64, 40
    torch.manual_seed(0)
    module = _Head(K, N).eval()
    weights = [module.body.weight.detach().numpy().T.copy(), module.lm_head.weight.detach().numpy().T.copy()]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="body"), helper.make_node("MatMul", ["h", "W2"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "T", N])],
                              [numpy_helper.from_array(weights[0], "W1"), numpy_helper.from_array(weights[1], "W2")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    out, note = convert(proto, "int4", embedding=embedding)
    bits = {n.output[0]: next((a.i for a in n.attribute if a.name == "bits"), None) for n in out.graph.node if n.op_type in ("MatMulNBits", "MatMul")}
    assert bits == {"h": 4, "logits": head_bits}
    assert any("the head, stored as the embedding table is: --embedding fp32" in k for k in note.kept) == (head_bits is None)
    x = (np.random.default_rng(1).standard_normal((2, 5, K)) * 2).astype(np.float32)
    reference = quantref.quantised_model(module, _manifest("int4", embedding=embedding))
    with torch.no_grad():
        got = reference(torch.from_numpy(x)).numpy()
    assert rel_l2(got, _run(out, x)) <= 1e-5


@pytest.mark.parametrize("tail", ["soft cap", "scale", "scale first"])
def test_an_untied_head_is_found_behind_a_soft_cap_or_a_constant_scale(tail):
    """A head whose logits pass through RecurrentGemma's soft cap c tanh(x / c) or a constant scale (Granite's
    logits_scaling, either operand order) is the head int4 stores as the table; a MatMul behind anything else
    (here an Add of two graph values) is not taken for it."""
    from edgelin.exporters.precision import untied_head

    K, N = 64, 40
    w = numpy_helper.from_array(np.ones((K, N), np.float32), "W")
    c = numpy_helper.from_array(np.array(30.0, np.float32), "c")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["z"], name="head")]
    if tail == "soft cap":
        nodes += [helper.make_node("Div", ["z", "c"], ["u"]), helper.make_node("Tanh", ["u"], ["t"]),
                  helper.make_node("Mul", ["t", "c"], ["logits"])]
    elif tail == "scale":
        nodes += [helper.make_node("Div", ["z", "c"], ["logits"])]
    else:
        nodes += [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
                  helper.make_node("Mul", ["k", "z"], ["logits"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", K])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "T", N])], [w, c])
    assert untied_head(graph).name == "head"
    graph.node[-1].input[:] = ["z", "x"] if tail != "scale first" else ["x", "z"]  # the other operand is not a constant
    graph.node[-1].op_type = "Add"
    assert untied_head(graph) is None


class _Outliers(torch.nn.Module):
    """x -> proj_in -> out_proj: a layer that names out_proj in ``eight_bit_linears`` (as Mamba-1's does)."""

    eight_bit_linears = ("out_proj",)

    def __init__(self, K: int) -> None:
        super().__init__()
        self.proj_in = torch.nn.Linear(K, K, bias=False)
        self.out_proj = torch.nn.Linear(K, K, bias=False)

    def forward(self, x):
        return self.out_proj(self.proj_in(x))


def test_an_int4_export_keeps_a_layers_eight_bit_linears_in_8_bit_blocks():
    """The linears a layer names in ``eight_bit_linears`` are found in the graph by their weights' bytes and stored as
    8-bit blocks (MatMulNBits bits 8), the others in 4 bits; quantref's model computes the same once the manifest
    records them, and 4 bits everywhere (measurably different) where it does not."""
    from edgelin.exporters.precision.int4 import eight_bit_digests

    K = 64
    torch.manual_seed(0)
    module = _Outliers(K).eval()
    assert quantref.eight_bit_linears(torch.nn.Sequential(module)) == [module.out_proj]
    weights = [module.proj_in.weight.detach().numpy().T.copy(), module.out_proj.weight.detach().numpy().T.copy()]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"), helper.make_node("MatMul", ["h", "W2"], ["y"], name="second")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "T", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "T", K])],
                              [numpy_helper.from_array(weights[0], "W1"), numpy_helper.from_array(weights[1], "W2")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    out, note = convert(proto, "int4", eight_bit=eight_bit_digests(quantref.eight_bit_linears(module)))
    bits = {n.output[0]: next(a.i for a in n.attribute if a.name == "bits") for n in out.graph.node if n.op_type == "MatMulNBits"}
    assert bits == {"h": 4, "y": 8} and note.eight_bit == 1
    x = (np.random.default_rng(2).standard_normal((2, 5, K)) * 2).astype(np.float32)
    recorded = _manifest("int4")
    recorded.extra["eight_bit_weights"] = 1
    assert "(1 with outlier inputs in 8-bit blocks)" in quantref.arithmetic(recorded)
    with torch.no_grad():
        got = quantref.quantised_model(module, recorded)(torch.from_numpy(x)).numpy()
        all_four = quantref.quantised_model(module, _manifest("int4"))(torch.from_numpy(x)).numpy()
    ref = _run(out, x)
    assert rel_l2(got, ref) <= 1e-5
    assert rel_l2(all_four, ref) > 100 * max(rel_l2(got, ref), 1e-7)


def test_mamba_layers_name_their_out_proj_for_8_bits():
    """Mamba-1's out_proj reads the scan's gated output, whose outlier channels cost most of int4's held-out loss
    (docs/importers.md): the layer names it."""
    from edgelin.layers.mamba import MambaMixer, MambaOptions

    layer = MambaMixer(MambaOptions(d_model=32, inner=64, state_size=8, dt_rank=4, conv_kernel=4))
    assert quantref.eight_bit_linears(layer) == [layer.out_proj]


@pytest.mark.parametrize("arith", list(ARITHMETICS))
def test_int8_and_int4_leave_each_router_in_fp32(arith):
    """A mixture-of-experts layer's router (its MatMul up to the TopK) stays an fp32 MatMul in int8 and int4, every
    expert's MatMuls are quantised, the note says why and counts it, and quantref's model computes the same once the
    manifest records it (and, with the router quantised, measurably not)."""
    import logging

    from edgelin.layers.moe import MoE, MoEOptions
    from edgelin.ops.moe import translation_table

    precision, scheme, op = ARITHMETICS[arith]
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    torch.manual_seed(0)
    moe = MoE(MoEOptions(d_model=64, num_experts=4, top_k=2, expert_hidden=32)).eval()
    with torch.no_grad():
        moe.router.weight.mul_(8.0)  # clear margins: the comparison below is of arithmetic, not of near ties
    dims = torch.export.Dim("B"), torch.export.Dim("T")
    program = torch.onnx.export(moe, (torch.randn(2, 5, 64),), input_names=["x"], output_names=["y"], dynamo=True, opset_version=18,
                                optimize=True, dynamic_shapes=({0: dims[0], 1: dims[1]},), custom_translation_table=translation_table())
    proto = program.model_proto
    shapes = {t.name: tuple(t.dims) for t in proto.graph.initializer}
    (router,) = [n.name for n in proto.graph.node if n.op_type == "MatMul" and shapes.get(n.input[1]) == (64, 4)]  # d x E
    out, note = convert(proto, precision, int8_scheme=scheme)
    ops = {n.name: n.op_type for n in out.graph.node}
    assert ops[router] == "MatMul" and note.fp32_routers == 1
    assert sum(t == op for t in ops.values()) == 3 * 4  # every expert's gate, up and down
    assert any(router in k and "mixture-of-experts router" in k for k in note.kept), note.kept
    x = np.random.default_rng(3).standard_normal((2, 7, 64)).astype(np.float32)
    recorded = _manifest(precision, scheme)
    recorded.extra["fp32_routers"] = 1
    assert "routers in fp32" in quantref.arithmetic(recorded)
    with torch.no_grad():
        got = quantref.quantised_model(moe, recorded)(torch.from_numpy(x)).numpy()
        routers_too = quantref.quantised_model(moe, _manifest(precision, scheme))(torch.from_numpy(x)).numpy()
    ref = _run(out, x)
    assert rel_l2(got, ref) <= 1e-5, rel_l2(got, ref)
    assert rel_l2(routers_too, ref) > 10 * max(rel_l2(got, ref), 1e-7)


def test_what_has_a_quantised_reference():
    assert quantref.arithmetic(_manifest("int8", "block")).startswith("8-bit weights in blocks of 32")
    assert quantref.arithmetic(_manifest("int8", "channel")).startswith("7-bit weights per output channel")
    assert quantref.arithmetic(_manifest("int4", embedding="fp32")).endswith("the embedding table in fp32")
    for manifest in (_manifest("fp32"), _manifest("fp16"), _manifest("int8", "block", embedding=None), _manifest("int8", "other")):
        assert quantref.arithmetic(manifest) is None
        assert quantref.quantised_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), manifest) is None


def _scales_of_first_nbits(export_dir) -> tuple[str, np.ndarray]:
    proto = onnx.load(str(export_dir / "prefill.onnx"))
    node = next(n for n in proto.graph.node if n.op_type == "MatMulNBits")
    scales = next(i for i in proto.graph.initializer if i.name == node.input[2])
    return node.name, numpy_helper.to_array(scales)


def _scale_all(export_dir, scales: np.ndarray, factor: float) -> None:
    """Every graph's copy of the scale initializer equal to ``scales`` multiplied by ``factor``."""
    for graph in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(export_dir / graph))
        hits = [i for i in proto.graph.initializer if i.dims == list(scales.shape) and np.array_equal(numpy_helper.to_array(i), scales)]
        assert len(hits) == 1, (graph, len(hits))
        hits[0].CopyFrom(numpy_helper.from_array(scales * np.float32(factor), hits[0].name))
        onnx.save(proto, str(export_dir / graph))


# tokens per prefill call of the Qwen3.5 export (fp16 and int8 share its trace): the delta rule's scan gets 4 levels at
# C = 64, not the default 4,096's 6 (a faster trace); the runtime's prefill pieces are 1,024 tokens either way
SCAN_BOUND = 1024


@pytest.mark.slow  # a transformers checkpoint, one int8 export, three validates (~1.5 min)
def test_a_gated_deltanet_hybrids_int8_states_are_held_to_its_quantisation(tmp_path, export_cache, trace_cache):
    """The bench's Qwen3.5 (hidden 256; Gated DeltaNet x3 + gated attention), exported in int8 with no scheme named:
    the block scheme (a transformers checkpoint's default) and the embedding recorded. Its states against fp32 PyTorch
    are out of int8's state bound (the quantisation moves a delta-rule state more than the logits) and within 1e-2 of
    the quantised reference; validate's prefill and decode checks pass against the reference. A broken scale (the
    first quantised matrix's scales x1.1: layer 0's input projection) fails every prefill check on layer 0's state S
    (rel L2 0.11-0.12 against the reference), the logits of some of them still within int8's budget (T = 1: rel L2
    0.11, max rel 0.10)."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    from edgelin.bench.llamacpp import build_checkpoint
    from edgelin.bench.transformers_eager import MODELS
    from edgelin.checkpoint import load_checkpoint
    from edgelin.exporters import export
    from edgelin.runtime import Session
    from edgelin.validate import FAIL, validate

    # the run's one build of this checkpoint, and its graphs traced once for the int8 and fp16 exports (test_precision_floor)
    ckpt = export_cache.get("bench-qwen3_5", MODELS["qwen3_5"], lambda folder: build_checkpoint("qwen3_5", folder, MODELS))
    out = tmp_path / "int8"
    export(ckpt, out, precision="int8", trace_cache=trace_cache, max_sequence=SCAN_BOUND)
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["int8_scheme"] == "block" and manifest["embedding"] == "int8"

    session = Session(out, "cpu", threads=1)
    model = load_checkpoint(ckpt).float().eval()
    quantised = quantref.quantised_model(model, session.manifest)
    ids = np.random.default_rng(0).integers(0, session.manifest.vocab_size, (2, 65))
    state = session.new_state(2)
    logits = session.prefill(ids, state)
    with torch.no_grad():
        ref, ref_state = model(torch.from_numpy(ids))
        _, q_state = quantised(torch.from_numpy(ids))
    got = state.numpy()
    vs_fp32 = max(rel_l2(got[s.input], ref_state[s.key].numpy()) for s in session.manifest.states)
    vs_quantised = max(rel_l2(got[s.input], q_state[s.key].numpy()) for s in session.manifest.states)
    assert vs_fp32 > BUDGETS["int8"]["state"]["rel_l2"] and vs_quantised <= 1e-2, (vs_fp32, vs_quantised)
    assert rel_l2(logits, ref.numpy()) <= BUDGETS["int8"]["logits"]["rel_l2"]

    report = validate(out, ckpt, steps=8, kv=[], upstream="off")
    held = [c for c in report.checks if c.group in ("prefill", "decode")]
    assert held and all(c.status != FAIL for c in held), report.table()
    assert report.state_reference == quantref.arithmetic(session.manifest) and "states held to PyTorch computing" in report.table()
    assert report.heldout["bytes"] >= report.heldout["tokens"] > 0  # the held-out text as its BPE reads it

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    node, scales = _scales_of_first_nbits(broken)
    _scale_all(broken, scales, 1.1)
    report = validate(broken, ckpt, steps=8, kv=[], upstream="off")
    prefill = [c for c in report.checks if c.group == "prefill"]
    assert all(c.status == FAIL and c.where.startswith("layer 0, state S") for c in prefill), f"{node}\n{report.table()}"
    assert any("(logits within budget)" in c.where for c in prefill), f"{node}\n{report.table()}"


@pytest.mark.parametrize("precision, scheme, tied", [("int4", None, True), ("int4", None, False), ("int8", "block", True)])
def test_the_reference_is_built_beside_the_model_without_copying_it(precision, scheme, tied, tmp_path):
    """quantised_model makes each weight of the reference from the model's one at a time: in memory, or written to a
    scratch file in a folder and mapped back (validate's, for a checkpoint whose weights are mapped from disk); both
    compute the same logits bitwise, the weights the export keeps as they are are the model's own (shared, not
    copied), and the model is left as it was."""
    from conftest import tiny_model
    from edgelin.state import fresh_state

    model = tiny_model(tie_embeddings=tied)
    before = {n: p.clone() for n, p in model.named_parameters()}
    manifest = _manifest(precision, scheme)
    in_memory = quantref.quantised_model(model, manifest)
    mapped = quantref.quantised_model(model, manifest, scratch=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the scratch file is unlinked once mapped
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = [q(ids, fresh_state(model.state_specs(), 2))[0] for q in (in_memory, mapped, model)]
    assert torch.equal(outs[0], outs[1])
    assert rel_l2(outs[0].numpy(), outs[2].numpy()) > 1e-4  # it is quantised
    own = {id(p) for p in model.parameters()}
    for q in (in_memory, mapped):
        shared = {n for n, p in q.named_parameters() if id(p) in own}
        assert shared and all(not n.endswith("proj.weight") and n != "embed.weight" for n in shared), shared
        assert "blocks.0.attn_norm.weight" in shared
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
