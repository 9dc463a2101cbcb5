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
    ACCURACY_LEVEL, DEFAULT_INT8_SCHEME, FLOAT, INT8_BLOCK, MS_DOMAIN, Conversion, int8_scheme_choice, slab_columns,
)
from edgelin.exporters.precision.fp16 import ROUTER_KEPT, router_matmuls
from edgelin.exporters.precision.tables import kept_matmuls, quantise_embedding, quantise_table
from edgelin.exporters import deferred
from edgelin.exporters.weights import Reuse, Spill, open_graph, save_graph, tensor_values


def convert_int8(proto: onnx.ModelProto, state_dtype: str, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME) -> tuple[onnx.ModelProto, Conversion]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.onnx"
        onnx.save(proto, str(src), save_as_external_data=True, location="in.onnx.data")  # no 2 GB limit
        out, note = int8_file(src, embedding, scheme)
        save_graph(out, src)  # the spilled int8 weights and what stayed fp32, into in.onnx.data
        note.spilled.unlink()
        note.spilled = None
        return onnx.load(str(src)), note  # in memory


def int8_file(path: Path, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME, reuse: Reuse | None = None) -> tuple[onnx.ModelProto, Conversion]:
    """``convert_int8`` of the fp32 graph file ``path`` (its weights in files beside it), one weight at a time, a slab of
    its columns at a time: read from the graph's data file, quantised, written to ``<name>.q8`` beside it (the note's
    ``spilled``: the export's ``save_graph`` adopts it as one of the graph's data files). Memory holds one weight in int8
    and a slab of it in float32, whatever the model's size (ONNX Runtime's ``quantize_dynamic`` held ~3x the weights,
    and needed them loaded beside it).
    Scheme "channel": quantize_dynamic's numbers (MatMul, per channel, reduce_range, QInt8: ``_quantise_matmuls``);
    the tests hold the two to bit equality. Scheme "block": MatMulNBits, 8 bits, block INT8_BLOCK."""
    int8_scheme_choice("int8", scheme)
    proto, read = open_graph(path), lambda t: tensor_values(t, path.parent)
    routers = router_matmuls(proto.graph)
    spill = path.with_name(path.name + ".q8")
    spill.unlink(missing_ok=True)
    with Spill(proto.graph, spill) as spilling:
        _quantise_matmuls(proto.graph, read, scheme, exclude=frozenset(routers), spill=spilling, reuse=reuse)
    tables = quantise_embedding(proto, embedding, read)  # what stays in fp32 stays in its file: save_graph copies it on
    note = Conversion("int8", kept=kept_matmuls(proto, "its weight is not a float [K, N] constant", tables, dict.fromkeys(routers, ROUTER_KEPT)),
                      fp32_routers=len(routers), spilled=spill)
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


def int8_columns_by_slabs(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``quantise_int8_columns`` of a [K, N] weight (any float dtype or layout: a memory map, a transposed view) a slab of
    columns at a time (each column's scale is its own: the same numbers): memory holds the int8 result and one slab in
    float32."""
    K, N = w.shape
    q, scale = np.empty((K, N), np.int8), np.empty(N, np.float32)
    step = slab_columns(K)
    for n in range(0, N, step):
        q[:, n:n + step], scale[n:n + step] = quantise_int8_columns(w[:, n:n + step])
    return q, scale


def int8_blocks_by_slabs(w: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``quantise_int8_blocks`` of a [K, N] weight a slab of columns at a time (each column's blocks are its own)."""
    K, N = w.shape
    blocks = -(-K // block)
    packed, scales = np.empty((N, blocks, block), np.uint8), np.empty(N * blocks, np.float32)
    step = slab_columns(blocks * block)
    for n in range(0, N, step):
        packed[n:n + step], scales[n * blocks:(n + step) * blocks] = quantise_int8_blocks(w[:, n:n + step], block)
    return packed, scales


def quantise_int8_blocks(w: np.ndarray, block: int = INT8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """A float32 [K, N] MatMul weight -> MatMulNBits' 8-bit B (uint8 [N, ceil(K / block), block]) and scales (float32
    [N * ceil(K / block)]): ``quantise_table`` of the transposed weight, K zero-padded to a whole block."""
    K, N = w.shape
    blocks = -(-K // block)
    t = np.zeros((N, blocks * block), np.float32)
    t[:, :K] = np.asarray(w, np.float32).T
    packed, scales = quantise_table(t, 8, block)
    return packed.reshape(N, blocks, block), scales.reshape(-1)


BLOCK_NAMES = ("_q8", "_q8_scales")  # MatMulNBits' B and scales, after the weight's name
CHANNEL_NAMES = ("_quantized", "_scale", "_zero_point")  # MatMulInteger's weight, its scales and zero points


def _quantise_matmuls(graph: onnx.GraphProto, read: Callable[[onnx.TensorProto], np.ndarray], scheme: str = DEFAULT_INT8_SCHEME,
                      only: frozenset[str] | None = None, exclude: frozenset[str] = frozenset(), spill: Spill | None = None,
                      reuse: Reuse | None = None) -> None:
    """Each MatMul of ``graph`` whose weight (input 1) is a float [K, N] initializer -> int8. Scheme "channel":
    quantize_dynamic's pattern: DynamicQuantizeLinear of the activation (one per activation, shared by its
    MatMuls), MatMulInteger on the int8 weight, Cast, and a Mul by the two scales. Scheme "block": one MatMulNBits
    (``quantise_int8_blocks``). A weight is read (``read``) and quantised once; one that no other node reads is
    dropped. ``only``: the names of the MatMuls to quantise (int4's 8-bit ones); None: every one but those ``exclude``
    names (the routers). ``spill``: where the quantised weights go as made (``Spill``); None: inline in the graph.
    ``reuse``: a weight made from a parameter in a graph saved before refers to those tensors instead (``Reuse``)."""
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
        if w not in weights:
            values = read(inits[w])
            key = deferred.identity(values)
            found = reuse.find(key) if reuse is not None else None
            if found is not None:  # made from the same parameter in a graph saved before: referred to there
                weights[w] = tuple(fresh(f"{w}{suffix}") for suffix in (BLOCK_NAMES if scheme == "block" else CHANNEL_NAMES))
                for name, t in zip(weights[w], found):
                    t.name = name
                    graph.initializer.append(t)
        if scheme == "block":
            if w not in weights:
                packed, scales = int8_blocks_by_slabs(values)
                names = tuple(fresh(f"{w}{suffix}") for suffix in BLOCK_NAMES)
                if spill is not None:
                    spill.add(names[0], packed, onnx.TensorProto.UINT8)
                    spill.add(names[1], scales, FLOAT)
                else:
                    t = graph.initializer.add()  # appended, not built and copied (see below)
                    t.name, t.data_type, t.raw_data = names[0], onnx.TensorProto.UINT8, packed.tobytes()
                    t.dims.extend(packed.shape)
                    graph.initializer.append(numpy_helper.from_array(scales, names[1]))
                del packed, values
                weights[w] = names
                if reuse is not None:
                    reuse.made(key, list(names))
            (wq, ws), (K, N) = weights[w], inits[w].dims
            replace[id(node)] = [helper.make_node("MatMulNBits", [x, wq, ws], list(node.output), name=fresh(f"{node.name}_q8"), domain=MS_DOMAIN,
                                                  K=K, N=N, bits=8, block_size=INT8_BLOCK, accuracy_level=ACCURACY_LEVEL)]
            continue
        if w not in weights:
            q, scale = int8_columns_by_slabs(values)
            del values
            names = tuple(fresh(f"{w}{suffix}") for suffix in CHANNEL_NAMES)
            # the per-channel scales and zero points as typed values, not raw bytes: they stay in the graph file,
            # as quantize_dynamic left them (external data moves raw bytes only; each would be padded there)
            # appended one by one (a list of them handed to extend() would be copied whole: 2x the int8 weights)
            if spill is not None:
                spill.add(names[0], q, onnx.TensorProto.INT8)
            else:
                t = graph.initializer.add()
                t.name, t.data_type, t.raw_data = names[0], onnx.TensorProto.INT8, q.tobytes()
                t.dims.extend(q.shape)
            del q
            graph.initializer.append(helper.make_tensor(names[1], FLOAT, scale.shape, scale.tolist()))
            graph.initializer.append(helper.make_tensor(names[2], onnx.TensorProto.INT8, scale.shape, [0] * scale.size))
            weights[w] = names
            if reuse is not None:
                reuse.made(key, list(names))
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
