"""int8: every MatMul with a constant weight quantised one weight at a time, read from the graph's data file
(``int8_file``): per channel as ONNX Runtime's quantize_dynamic does (scheme "channel"), or in blocks of 32 as
MatMulNBits (scheme "block"); the embedding table and a tied head as ``tables`` stores them."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgelin.exporters.precision.common import (
    ACCURACY_LEVEL, DEFAULT_INT8_SCHEME, FLOAT, INT8_BLOCK, MS_DOMAIN, Conversion, int8_scheme_choice,
)
from edgelin.exporters.precision.fp16 import ROUTER_KEPT, router_matmuls
from edgelin.exporters.precision.tables import kept_matmuls, quantise_embedding, quantise_table
from edgelin.exporters.weights import open_graph, tensor_values


def convert_int8(proto: onnx.ModelProto, state_dtype: str, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME) -> tuple[onnx.ModelProto, Conversion]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.onnx"
        onnx.save(proto, str(src), save_as_external_data=True, location="in.onnx.data")  # no 2 GB limit
        out, note = int8_file(src, embedding, scheme)
        onnx.load_external_data_for_model(out, tmp)  # what stayed fp32, in memory as it came
        return out, note


def int8_file(path: Path, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME) -> tuple[onnx.ModelProto, Conversion]:
    """``convert_int8`` of the fp32 graph file ``path`` (its weights in files beside it), read one weight at a time: the
    graph in memory holds the int8 weights and what stays in fp32, never the fp32 weights beside a quantiser's own
    copies (ONNX Runtime's ``quantize_dynamic`` held ~3x the weights, and needed them loaded beside it).
    Scheme "channel": quantize_dynamic's numbers (MatMul, per channel, reduce_range, QInt8: ``_quantise_matmuls``);
    the tests hold the two to bit equality. Scheme "block": MatMulNBits, 8 bits, block INT8_BLOCK."""
    int8_scheme_choice("int8", scheme)
    proto, read = open_graph(path), lambda t: tensor_values(t, path.parent)
    routers = router_matmuls(proto.graph)
    _quantise_matmuls(proto.graph, read, scheme, exclude=frozenset(routers))
    tables = quantise_embedding(proto, embedding, read)  # what stays in fp32 stays in its file: save_graph copies it on
    note = Conversion("int8", kept=kept_matmuls(proto, "its weight is not a float [K, N] constant", tables, dict.fromkeys(routers, ROUTER_KEPT)),
                      fp32_routers=len(routers))
    return proto, note


_INT8_STEP = 128.0  # reduce_range's int8 range, [-64, 64], as quantize_dynamic computes a symmetric scale over it


def quantise_int8_columns(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float32 [K, N] MatMul weight -> (int8 [K, N], float32 [N] scales), as ONNX Runtime's quantize_dynamic does
    per channel with reduce_range (symmetric over [-64, 64], zero point 0, rounding half to even, clipped to int8)."""
    w = np.asarray(w, dtype=np.float32)
    absmax = np.maximum(np.abs(np.minimum(w.min(0), 0)), np.abs(np.maximum(w.max(0), 0)))
    scale64 = (absmax.astype(np.float64) * 2) / _INT8_STEP
    scale = np.where(scale64 < np.finfo(np.float32).tiny, 1.0, scale64).astype(np.float32)
    q = np.round(w / scale)
    np.clip(q, -128, 127, out=q)
    return q.astype(np.int8), scale


def quantise_int8_blocks(w: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """A float32 [K, N] MatMul weight -> MatMulNBits' 8-bit B (uint8 [N, ceil(K / block), block]) and scales (float32
    [N * ceil(K / block)]): ``quantise_table`` of the transposed weight, K zero-padded to a whole block."""
    K, N = w.shape
    blocks = -(-K // block)
    t = np.zeros((N, blocks * block), np.float32)
    t[:, :K] = np.asarray(w, np.float32).T
    packed, scales = quantise_table(t, 8, block)
    return packed.reshape(N, blocks, block), scales.reshape(-1)


def _quantise_matmuls(graph: onnx.GraphProto, read: Callable[[onnx.TensorProto], np.ndarray], scheme: str = DEFAULT_INT8_SCHEME,
                      only: frozenset[str] | None = None, exclude: frozenset[str] = frozenset()) -> None:
    """Each MatMul of ``graph`` whose weight (input 1) is a float [K, N] initializer -> int8. Scheme "channel":
    quantize_dynamic's pattern: DynamicQuantizeLinear of the activation (one per activation, shared by its
    MatMuls), MatMulInteger on the int8 weight, Cast, and a Mul by the two scales. Scheme "block": one MatMulNBits
    (``quantise_int8_blocks``). A weight is read (``read``) and quantised once; one that no other node reads is
    dropped. ``only``: the names of the MatMuls to quantise (int4's 8-bit ones); None: every one but those ``exclude``
    names (the routers)."""
    inits = {t.name: t for t in graph.initializer}
    targets = [n for n in graph.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and n.input[1] in inits
               and inits[n.input[1]].data_type == FLOAT and len(inits[n.input[1]].dims) == 2 and n.input[0] not in inits
               and (only is None or n.name in only) and n.name not in exclude]
    if not targets:
        return
    taken = {v for n in graph.node for v in (*n.input, *n.output)} | set(inits) | {i.name for i in graph.input}
    def fresh(name: str) -> str:
        out, k = name, 0
        while out in taken:
            k += 1
            out = f"{name}_{k}"
        taken.add(out)
        return out
    weights: dict[str, tuple[str, ...]] = {}  # weight -> its quantised initializers: (int8 weight, scale, zero point), or (B, scales)
    activations: dict[str, tuple[str, str, str]] = {}  # activation -> DynamicQuantizeLinear's outputs
    replace: dict[int, list[onnx.NodeProto]] = {}
    for node in targets:
        x, w = node.input[0], node.input[1]
        new = []
        if scheme == "block":
            if w not in weights:
                packed, scales = quantise_int8_blocks(read(inits[w]))
                names = (fresh(f"{w}_q8"), fresh(f"{w}_q8_scales"))
                t = graph.initializer.add()  # appended, not built and copied (see below)
                t.name, t.data_type, t.raw_data = names[0], onnx.TensorProto.UINT8, packed.tobytes()
                t.dims.extend(packed.shape)
                del packed
                graph.initializer.append(numpy_helper.from_array(scales, names[1]))
                weights[w] = names
            (wq, ws), (K, N) = weights[w], inits[w].dims
            replace[id(node)] = [helper.make_node("MatMulNBits", [x, wq, ws], list(node.output), name=fresh(f"{node.name}_q8"), domain=MS_DOMAIN,
                                                  K=K, N=N, bits=8, block_size=INT8_BLOCK, accuracy_level=ACCURACY_LEVEL)]
            continue
        if w not in weights:
            q, scale = quantise_int8_columns(read(inits[w]))
            names = (fresh(f"{w}_quantized"), fresh(f"{w}_scale"), fresh(f"{w}_zero_point"))
            # the per-channel scales and zero points as typed values, not raw bytes: they stay in the graph file,
            # as quantize_dynamic left them (external data moves raw bytes only; each would be padded there)
            # appended one by one (a list of them handed to extend() would be copied whole: 2x the int8 weights)
            t = graph.initializer.add()
            t.name, t.data_type, t.raw_data = names[0], onnx.TensorProto.INT8, q.tobytes()
            t.dims.extend(q.shape)
            del q
            graph.initializer.append(helper.make_tensor(names[1], FLOAT, scale.shape, scale.tolist()))
            graph.initializer.append(helper.make_tensor(names[2], onnx.TensorProto.INT8, scale.shape, [0] * scale.size))
            weights[w] = names
        if x not in activations:
            activations[x] = (fresh(f"{x}_quantized"), fresh(f"{x}_scale"), fresh(f"{x}_zero_point"))
            new.append(helper.make_node("DynamicQuantizeLinear", [x], list(activations[x]), name=fresh(f"{x}_QuantizeLinear")))
        xq, xs, xz = activations[x]
        wq, ws, wz = weights[w]
        out = node.output[0]
        both, acc, cast = fresh(f"{out}_scale_mul"), fresh(f"{out}_output_quantized"), fresh(f"{out}_output_quantized_cast")
        new += [helper.make_node("Mul", [xs, ws], [both], name=fresh(f"{node.name}_scales_mul")),
                helper.make_node("MatMulInteger", [xq, wq, xz, wz], [acc], name=fresh(f"{node.name}_quant")),
                helper.make_node("Cast", [acc], [cast], to=FLOAT, name=fresh(f"{node.name}_cast")),
                helper.make_node("Mul", [cast, both], [out], name=fresh(f"{node.name}_output_scale_mul"))]
        replace[id(node)] = new
    nodes = [m for n in graph.node for m in replace.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(nodes)
    still = {v for n in graph.node for v in n.input} | {o.name for o in graph.output}
    for i in reversed(range(len(graph.initializer))):  # in place: the others are not copied
        if graph.initializer[i].name in weights and graph.initializer[i].name not in still:
            del graph.initializer[i]
