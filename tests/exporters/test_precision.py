"""Export precisions (fp16, int8, int4): the conversion, the manifest, the runtime, and validate's budgets,
including a deliberately broken quantisation that the budgets must catch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from edgelin.errors import ExportError
from edgelin.exporters import export
from edgelin.exporters.precision import CONVERTERS, INT4_BLOCK, accumulator_region, decay_region
from edgelin.parity import BUDGETS, errors, within
from edgelin.runtime.session import Session
from edgelin.validate import FAIL, validate

LOW = ["fp16", "int8", "int4"]


@pytest.fixture(scope="module")
def model(exported):
    return exported("elu+1")[0]  # conftest's tiny model


@pytest.fixture(scope="module")
def exports(exported):
    """(precision, state dtype) -> export folder of the tiny model, each exported once per run (with the smoke
    check). Shared: a test that changes one copies it."""

    def get(precision: str, state_dtype: str = "float32"):
        return exported("elu+1", options={"precision": precision, "state_dtype": state_dtype, "check": True})[1]

    return get


def test_every_precision_has_a_converter_and_the_same_budget_kinds():
    assert set(CONVERTERS) == set(BUDGETS)
    for precision, table in BUDGETS.items():
        assert set(table) == set(BUDGETS["fp32"]), precision


@pytest.mark.parametrize("precision", LOW)
def test_manifest_and_runtime(exports, precision):
    out = exports(precision)
    manifest = json.loads((out / "edgelin.json").read_text())
    assert manifest["precision"] == precision
    assert {s["dtype"] for s in manifest["states"]} == {"float32"}
    session = Session(out, "cpu", threads=1)  # checks graph IO against the manifest
    state = session.new_state(2)
    ids = np.random.default_rng(0).integers(0, 256, (2, 21))
    logits = session.prefill(ids, state)
    assert logits.shape == (2, 21, 256) and np.isfinite(logits).all()
    assert np.isfinite(session.decode(ids[:, :1], state)).all()


def test_fp16_keeps_the_accumulators_in_fp32(exports):
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(exports("fp16") / "decode.onnx")))
    types = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.value_info, *proto.graph.input, *proto.graph.output]}
    producer = {o: n for n in proto.graph.node for o in n.output}
    for out in proto.graph.output:
        if out.name.rsplit(".", 1)[-1] in ("S", "z"):
            add = producer[out.name]
            while add.op_type == "Cast":  # a copy (Cast to fp32 of an fp32 value) may sit before the output
                assert types[add.input[0]] == onnx.TensorProto.FLOAT, add.name
                add = producer[add.input[0]]
            assert add.op_type == "Add" and types[out.name] == onnx.TensorProto.FLOAT
            assert all(types[i] == onnx.TensorProto.FLOAT for i in add.input), add.name
    weights = [i for i in proto.graph.initializer if len(i.dims) == 2]
    assert weights and all(w.data_type == onnx.TensorProto.FLOAT16 for w in weights)


def test_accumulator_region_of_the_fp32_graph(exported):
    """From S and z to the normalising division, per layer; not the conv window, not a shape read."""
    _, out = exported("elu+1")
    graph = onnx.load(str(out / "decode.onnx")).graph
    region = {n.name: n for n in graph.node if n.name in accumulator_region(graph)}
    ops = [n.op_type for n in region.values()]
    assert ops.count("Div") == 2 and "Shape" not in ops and "Conv" not in ops
    weights = {i.name for i in graph.initializer}
    matmuls = [n for n in region.values() if n.op_type == "MatMul"]
    assert len(matmuls) == 4 and not any(set(n.input) & weights for n in matmuls)  # phi(q) S and phi(q) z per layer, no weight


@pytest.mark.slow  # a transformers checkpoint built in a subprocess, then two fp16 exports (~1 min)
def test_a_mamba2_in_fp16_keeps_its_decays_in_fp32_and_passes_its_smoke_check(tmp_path, monkeypatch):
    """A Mamba2 (hidden 256, 4 layers, transformers' own class) in fp16: its decays' path from each Softplus to the
    running sums stays fp32 and the smoke check against PyTorch passes. With its log-decays in fp16 the prefill's
    logits miss the fp16 budget (max rel 9.2e-3 > 8e-3) and transformers' own fp16 error as well (6.6e-3 on the same
    ids): the export is refused, naming both."""
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    from edgelin.bench.llamacpp import build_checkpoint

    ckpt = build_checkpoint("mamba2", tmp_path / "ckpt")
    traces = tmp_path / "traces"  # one trace for the three exports: what they change comes after it
    fp32 = onnx.load(str(export(ckpt, tmp_path / "fp32", check=False, trace_cache=traces).out_dir / "prefill.onnx"), load_external_data=False).graph
    accumulators = accumulator_region(fp32)
    decays = {n.name: n for n in fp32.node if n.name in decay_region(fp32, accumulators)}
    ops = [n.op_type for n in decays.values()]
    assert ops.count("Softplus") == 4 and ops.count("CumSum") == 0 and not set(decays) & accumulators  # CumSums are accumulators
    assert "MatMul" not in ops and "Conv" not in ops  # the path only: not the projections or the conv
    out = tmp_path / "fp16"
    export(ckpt, out, precision="fp16", trace_cache=traces)  # raises ExportError where the smoke check misses the budget
    manifest = json.loads((out / "edgelin.json").read_text())
    kept = manifest["precision_kept"]
    assert any("decays' path" in line for line in kept["prefill"]) and any("decays' path" in line for line in kept["decode"])
    assert "precision_floor" not in manifest  # within edgelin's budget: the framework was not asked
    import edgelin.exporters.precision.fp16 as conversion

    monkeypatch.setattr(conversion, "decay_region", lambda graph, accumulators: set())  # the decays in fp16, as before
    with pytest.raises(ExportError, match=r"smoke check failed: prefill .*transformers' own model in float16 is") as info:
        export(ckpt, tmp_path / "broken", precision="fp16", trace_cache=traces)
    assert not (tmp_path / "broken").exists(), str(info.value)


def test_fp16_state_option(exported, tmp_path):
    """A decayed model may keep its state in float16: the manifest says so, the runtime holds fp16 arrays,
    and validate (including its long stream) holds it to the fp16 budgets. The model is the decayed one whose fp32
    graphs tests/exporters/test_parity.py and tests/test_decay_model.py export: its graphs come from the run's trace cache."""
    model, out = exported("relu", decay="scalar", options={"precision": "fp16", "state_dtype": "float16", "check": True})
    manifest = json.loads((out / "edgelin.json").read_text())
    assert {s["dtype"] for s in manifest["states"]} == {"float16"}
    session = Session(out, "cpu", threads=1)
    state = session.new_state(1)
    assert {v.dtype for v in state.numpy().values()} == {np.dtype(np.float16)}
    assert validate(out, model).passed


def test_fp16_state_is_refused_for_running_sums_without_decay(model, tmp_path):
    """Without decay z and S sum every token: float16 rounds new tokens away after ~2k and overflows later."""
    with pytest.raises(ExportError, match="without decay.*keep --state-dtype float32"):
        export(model, tmp_path / "out", precision="fp16", state_dtype="float16")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("precision", "op"), [("int8", "MatMulInteger"), ("int4", "MatMulNBits")], ids=["int8", "int4"])
def test_quantised_ops_and_kept_tensors(exports, precision, op):
    out = exports(precision)
    proto = onnx.load(str(out / "decode.onnx"))
    ops = [n.op_type for n in proto.graph.node]
    assert any(op in o for o in ops), sorted(set(ops))
    if precision == "int4":
        for n in proto.graph.node:
            if n.op_type == "MatMulNBits":
                assert {a.name: a.i for a in n.attribute}["block_size"] == INT4_BLOCK
    kept = json.loads((out / "edgelin.json").read_text())["precision_kept"]["decode"]
    # the embedding is block-quantised (8-bit by default), so nothing of it is kept: no fp32 table, no fp32 head
    assert not any("embedding" in k or "tied head" in k for k in kept), kept
    gathers = [n for n in proto.graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(gathers) == 1 and {a.name: a.i for a in gathers[0].attribute}["bits"] == 8
    assert "model.embed.weight" not in {i.name for i in proto.graph.initializer}


def test_an_untied_model_is_not_said_to_have_a_tied_head(exported):
    """precision_kept tells what the graph does: an untied model's embedding kept in fp32 (--embedding fp32) is said
    to be kept for that, not for a head it does not share; int4 stores the untied head as the table (fp32 here, said
    so), its other MatMuls in 4 bits."""
    _, out = exported("elu+1", tie_embeddings=False, options={"precision": "int4", "embedding": "fp32"})
    kept = json.loads((out / "edgelin.json").read_text())["precision_kept"]["decode"]
    assert not any("tied" in k for k in kept), kept
    assert "embedding Gather model.embed.weight (fp32: --embedding fp32)" in kept, kept
    assert sum("(fp32: the head, stored as the embedding table is: --embedding fp32)" in k for k in kept) == 1, kept
    proto = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    inits = {i.name: i for i in proto.graph.initializer}
    heads = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits and inits[n.input[1]].dims[-1] == 256]
    assert len(heads) == 1, "the untied head (N = the vocabulary) is not one fp32 MatMul"
    assert any(n.op_type == "MatMulNBits" and {a.name: a.i for a in n.attribute}["bits"] == 4 for n in proto.graph.node)


def test_int8_weights_use_seven_bits(exports):
    """int8 weights stay in [-64, 64] (reduce_range: 255 x 64 x 2 fits in int16): full-range weights saturate ONNX Runtime's u8 x s8
    kernel on x86 CPUs without VNNI (AVX2 only), where the tiny model's logits were off by rel L2 0.68."""
    for graph in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(exports("int8") / graph))
        quantised = [onnx.numpy_helper.to_array(t) for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8]
        assert quantised, f"{graph}: no int8 weights"
        assert all(w.min() >= -64 and w.max() <= 64 for w in quantised), f"{graph}: an int8 weight outside [-64, 64]"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_validate_holds_the_tiny_model_to_its_budget(exports, model, precision):
    """fp32 and fp16 hold on the random tiny model too; int8/int4 budgets are measured on the trained bundled
    model (below), which the random tiny model (weights x15, 9.6 bits/byte held out) does not resemble."""
    report = validate(exports(precision), model)
    assert report.passed, report.table()
    assert report.precision == precision
    assert report.heldout["bytes"] > 0 and abs(report.heldout["bpb_delta"]) <= BUDGETS[precision]["heldout"]["max_bpb_delta"]


# ---- the bundled model: the budgets hold, and a broken quantisation fails them -------------------------
QUANTISED = {"int8": ("int8", {}), "int4": ("int4", {}), "int8-block": ("int8", {"int8_scheme": "block"})}  # id -> (precision, options)


@pytest.mark.slow
@pytest.mark.parametrize("variant", QUANTISED)
def test_bundled_model_within_its_budgets(bundled_export, variant):
    precision, options = QUANTISED[variant]
    report = validate(bundled_export(precision, **options), steps=8)
    assert report.passed, report.table()
    assert report.precision == precision
    assert report.heldout["bytes"] > 0 and abs(report.heldout["bpb_delta"]) <= BUDGETS[precision]["heldout"]["max_bpb_delta"]


def _activations(export_dir, names: list[str], windows: int = 8, length: int = 256) -> dict[str, np.ndarray]:
    """The fp32 tensors ``names`` of the prefill graph over the first windows x length held-out bytes, each
    flattened to [tokens, features] (the graph run with those tensors added as outputs)."""
    import onnxruntime as ort

    from edgelin.runtime.manifest import Manifest
    from edgelin.validate import heldout_text

    manifest = Manifest.load(export_dir)
    text = heldout_text(manifest)
    ids = np.frombuffer(text[: windows * length], np.uint8).astype(np.int64).reshape(windows, length)
    proto = onnx.load(str(export_dir / "prefill.onnx"))
    for name in names:
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = ({"input_ids": ids} | manifest.prefill_positions(*ids.shape)
            | {s.input: np.full(s.concrete_shape(windows), s.init, s.np_dtype) for s in manifest.states})
    return {n: a.reshape(-1, a.shape[-1]) for n, a in zip(names, session.run(names, feed))}


def _nbits_weights(inits: dict[str, np.ndarray], node: onnx.NodeProto) -> np.ndarray:
    """A symmetric MatMulNBits weight (4 or 8 bits) dequantised: [N, K padded to blocks] (zero point 2^(bits-1);
    4 bits: low nibble first)."""
    attrs = {a.name: a.i for a in node.attribute}
    n, bits = attrs["N"], attrs["bits"]
    packed = inits[node.input[1]]  # [N, blocks, block * bits / 8] uint8
    scales = inits[node.input[2]].reshape(n, -1)  # [N, blocks]
    codes = np.stack([packed & 0xF, packed >> 4], -1) if bits == 4 else packed
    values = codes.reshape(n, scales.shape[1], -1).astype(np.float32) - (1 << (bits - 1))  # [N, blocks, block]
    return (values * scales[..., None]).reshape(n, -1)


def _nbits_most_used(export_dir, rows: int) -> tuple[str, np.ndarray, np.ndarray]:
    """(node, its scales, flat indices of the scales of its ``rows`` most used output rows): the MatMulNBits
    holding the single block that adds most to its output on held-out text (mean |x_block . w_block| over
    tokens), and that matrix's rows ordered by mean |output|."""
    proto = onnx.load(str(export_dir / "prefill.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    acts = _activations(export_dir, sorted({n.input[0] for n in nodes}))
    best = None
    for node in nodes:
        w = _nbits_weights(inits, node)  # [N, Kp]
        x = acts[node.input[0]]
        x = np.pad(x, ((0, 0), (0, w.shape[1] - x.shape[1])))  # [tokens, Kp]
        per_block = np.einsum("tbk,nbk->tnb", x.reshape(len(x), -1, INT4_BLOCK), w.reshape(len(w), -1, INT4_BLOCK))  # [tokens, N, blocks]
        blocks = np.abs(per_block).mean(0)  # [N, blocks]
        if best is None or blocks.max() > best[0]:
            used = np.abs(x @ w.T).mean(0)  # [N] mean |output| per row
            best = (float(blocks.max()), node, used, blocks.shape[1])
    _, node, used, per_row = best
    top = np.argsort(-used)[:rows]
    return node.name, inits[node.input[2]], np.concatenate([np.arange(r * per_row, (r + 1) * per_row) for r in top])


def _int8_most_used(export_dir, channels: int) -> tuple[str, np.ndarray, np.ndarray]:
    """(node, its per-channel weight scales, the indices of its ``channels`` most used channels): the
    MatMulInteger whose most used output channel (largest mean |output| on held-out text) is the largest of
    any, and that matrix's channels ordered by mean |output|."""
    proto = onnx.load(str(export_dir / "prefill.onnx"))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulInteger"]
    source = {n.name: producer[n.input[0]].input[0] for n in nodes}  # the fp32 input of its DynamicQuantizeLinear
    acts = _activations(export_dir, sorted(set(source.values())))
    best = None
    for node in nodes:
        scale = node.input[1].replace("_quantized", "_scale")
        w = (inits[node.input[1]].astype(np.float32) - inits[node.input[3]].astype(np.float32)) * inits[scale]  # [K, N]
        used = np.abs(acts[source[node.name]] @ w).mean(0)  # [N]
        if best is None or used.max() > best[0]:
            best = (float(used.max()), node.name, inits[scale], np.argsort(-used)[:channels])
    return best[1:]


def _scale_in_every_graph(export_dir, scales: np.ndarray, index: np.ndarray, factor: float) -> None:
    """Multiply entries ``index`` (flat) of the scale initializer equal to ``scales`` in both graphs (the
    prefill and decode graphs quantise the same weight to the same scales, under different names)."""
    for graph in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(export_dir / graph))
        hits = [i for i in proto.graph.initializer if i.dims == list(scales.shape) and np.array_equal(onnx.numpy_helper.to_array(i), scales)]
        assert len(hits) == 1, (graph, len(hits))
        values = scales.copy()
        values.reshape(-1)[index] *= factor
        hits[0].CopyFrom(onnx.numpy_helper.from_array(values, hits[0].name))
        onnx.save(proto, str(export_dir / graph))


BROKEN = {
    # the weight scales of the 16 most used output channels (of 256) of the matrix with the most used channel,
    # x2. Measured on the bundled model (stdlib-linear; validate seed 0, steps 8; the unbroken export: held-out
    # delta +0.0005, top-1 on random ids 95.0 %): one channel x2 passes every budget (top-1 85.75 %, delta
    # +0.0016); 4 channels fail only top-1 on random ids (not a stable measure, see parity.py); 16 fail the
    # states of prefill and decode and top-1 (held-out delta +0.0058, top-1 96.5 %). On the previous bundled
    # model one channel x2 was enough.
    "int8": (lambda d: _int8_most_used(d, channels=16), {"prefill", "decode"}),
    # 32 rows (256 blocks) of the matrix holding the most used block: held-out delta +0.0408 (budget 0.02),
    # top-1 88.6 % (0.92), state S of layer 3 rel L2 0.44 (0.3).
    "int4": (lambda d: _nbits_most_used(d, rows=32), {"prefill", "decode", "precision"}),
    # --int8-scheme block: the scales of the 4 most used rows (88 blocks) of the matrix holding the most used block,
    # x2. Measured (validate seed 0, steps 8; the unbroken export: held-out delta -0.0002): 1 row passes every
    # budget (delta +0.0039); 4 rows fail prefill, decode, golden, top-1 (61.5 %) and held-out (delta +0.0275).
    "int8-block": (lambda d: _nbits_most_used(d, rows=4), {"prefill", "decode"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", QUANTISED)
def test_a_broken_quantisation_fails_the_budgets(bundled_export, tmp_path, variant):
    """A weight scale doubled in both graphs of the bundled model's export fails validate's budgets.

    int8: the per-channel scales of the 16 most used output channels of one matrix x2 (see BROKEN).

    int4: one block is below the budgets' resolution. Measured on the previous bundled model, pydoc-linear
    (seed 0, steps 8, held-out 7,936 bytes; the unbroken export: delta +0.0074, held-out top-1 95.06 %): the block adding most to its output on held-out
    text (layer-1 attention output projection, row 135, block 0, mean |contribution| 2.0) x2 passes every budget
    (delta +0.0067, top-1 95.06 %); so do one full row of 22 blocks (the most used row, MLP down-projection of
    layer 0; delta -0.0015) and 8 rows of the projection (delta +0.0065, top-1 92.4 %). 16 rows fail on the
    held-out delta alone, by a hair (+0.0203); 32 rows (256 blocks, 0.26 % of the int4 weights) fail three
    checks with margin, and that is what this test breaks; on the current bundled model they still fail it. The int4 budgets are set about 3x above the
    int4 model's own error, which one 32-weight block does not reach.
    """
    select, expected = BROKEN[variant]
    precision, options = QUANTISED[variant]
    out = tmp_path / "broken"
    shutil.copytree(bundled_export(precision, **options), out)
    node, scales, index = select(out)
    _scale_in_every_graph(out, scales, index, 2.0)
    report = validate(out, steps=8)
    failed = {c.group for c in report.checks if c.status == FAIL}
    assert not report.passed and expected <= failed, f"{node}: {index.size} scales x2\n{report.table()}"
    # the numbers catch it: every structure check but the file hashes (the scales were edited in place) passes
    assert all(c.status != FAIL for c in report.checks if c.group in ("structure", "graphs") and "sha256" not in c.name), report.table()
    assert next(c for c in report.checks if "sha256" in c.name).status == FAIL


@pytest.mark.parametrize(("precision", "state_dtype", "needle"), [
    pytest.param("int3", "float32", "choose one of fp32, fp16, int8, int4", id="unknown-precision"),
    pytest.param("int8", "float16", "needs --precision fp16", id="fp16-state-without-fp16"),
    pytest.param("fp16", "bfloat16", "choose one of float32, float16", id="unknown-state-dtype"),
])
def test_bad_precision_options(model, tmp_path, precision, state_dtype, needle):
    with pytest.raises(ExportError, match=needle):
        export(model, tmp_path / "out", precision=precision, state_dtype=state_dtype)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_cli_lists_the_precisions(tmp_path):
    from edgelin.cli import main

    result = CliRunner().invoke(main, ["export", "-o", str(tmp_path / "out"), "--precision", "int3"])
    assert result.exit_code == 2
    assert all(p in result.output for p in BUDGETS) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_long_stream_in_state_carried_pieces_stays_finite_and_near_float64(exports, model, precision):
    """16,384 tokens in prefill pieces of 1,024 (state carried), then 16 decode steps, against a float64
    PyTorch run: finite throughout, within the precision's long-stream budget, while z grows with the
    tokens read (the running sums of a map without decay). The full figures (100k tokens, the bundled
    model) are in the README, from scripts/long_stream.py."""
    import copy

    import torch

    from edgelin.state import fresh_state

    session = Session(exports(precision), "cpu", threads=1)
    model64 = copy.deepcopy(model).double().eval()
    ids = np.random.default_rng(0).integers(0, 256, (1, 16_384 + 16))
    state, ref_state = session.new_state(1), fresh_state(session.manifest.states, 1, dtype=torch.float64)
    bounds, worst, z = BUDGETS[precision]["long"], None, []
    for start in range(0, 16_384, 1024):
        got = session.prefill(ids[:, start : start + 1024], state)
        with torch.no_grad():
            ref, ref_state = model64(torch.from_numpy(ids[:, start : start + 1024]), ref_state)
        err = errors(got, ref.numpy())
        worst = err if worst is None else worst.worst(err)
        assert all(np.isfinite(v).all() for v in state.numpy().values()), start
        z.append(max(float(v.abs().max()) for k, v in ref_state.items() if k.endswith(".z")))
    for t in range(16_384, 16_384 + 16):
        got = session.decode(ids[:, t : t + 1], state)
        with torch.no_grad():
            ref, ref_state = model64.step(torch.from_numpy(ids[:, t : t + 1]), ref_state)
        worst = worst.worst(errors(got, ref.numpy()))
    assert within(worst, bounds), (worst, bounds)
    assert z[-1] > 8 * z[0]  # 16x the tokens: the sums grew (a stream that did not grow would prove little)


def test_int4_conversion_leaves_the_processs_logging_alone():
    """ONNX Runtime's matmul_nbits_quantizer calls logging.basicConfig(level=INFO) when imported: after one int4
    conversion, every INFO record of the process (onnx_ir's, in a later export) was printed. In a fresh interpreter,
    where that module has not been imported yet."""
    code = textwrap.dedent(
        """
        import logging
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper
        from edgelin.exporters.precision import convert
        w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
        graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [w])
        root = logging.getLogger()
        before = (list(root.handlers), root.level)
        out, note = convert(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), "int4")
        assert [n.op_type for n in out.graph.node] == ["MatMulNBits"], [n.op_type for n in out.graph.node]
        assert (list(root.handlers), root.level) == before, (root.handlers, root.level, before)
        logging.getLogger("onnx_ir").info("must not be printed")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "must not be printed" not in done.stderr + done.stdout
