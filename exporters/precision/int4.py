"""int4: 4-bit symmetric block-quantised weights, block 32 (ONNX Runtime's ``MatMulNBitsQuantizer``), an untied
head stored as the embedding table is, and the table and a tied head as ``tables`` stores them."""

from __future__ import annotations

import hashlib
import importlib
import logging
from pathlib import Path
from typing import Callable

import numpy as np

import onnx
from onnx import helper, numpy_helper

from edgelin.exporters.precision.common import (
    ACCURACY_LEVEL, EMBEDDING_BITS, FLOAT, INT4_BLOCK, MS_DOMAIN, TABLE_BLOCK, Conversion, quiet, slab_columns,
)
from edgelin.exporters.precision.fp16 import ROUTER_KEPT, router_matmuls
from edgelin.exporters.precision.int8 import _quantise_matmuls
from edgelin.exporters.precision.tables import kept_matmuls, quantise_embedding, quantise_table, table_heads
from edgelin.exporters import deferred
from edgelin.exporters.weights import Reuse, Spill, open_graph, tensor_values


def _import_leaving_logging_alone(module: str):
    """Import ``module`` and undo any change it made to the root logger: ONNX Runtime's matmul_nbits_quantizer calls
    ``logging.basicConfig(level=INFO)`` on import, after which every INFO record of the process (onnx_ir's, during a
    later export in the same process) was printed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return importlib.import_module(module)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def untied_head(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul with a constant float [K, N] weight that computes the logits output (an untied head), or None (a
    tied head reads the embedding transposed; a model whose logits come otherwise). Followed back from the logits
    through reshapes and casts, a constant scale (Granite's logits_scaling: a Div) and a soft cap c tanh(x / c)
    (RecurrentGemma's: Div, Tanh, Mul)."""
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def constant(name: str) -> bool:
        return name in inits or (name in producer and producer[name].op_type == "Constant")

    node = producer.get("logits")  # the exporter names it so (exporters/graphs.py: LOGITS)
    while node is not None:
        if node.op_type in ("Identity", "Reshape", "Cast", "Squeeze", "Unsqueeze", "Tanh"):
            node = producer.get(node.input[0])
        elif node.op_type in ("Mul", "Div") and constant(node.input[1]):
            node = producer.get(node.input[0])
        elif node.op_type == "Mul" and constant(node.input[0]):
            node = producer.get(node.input[1])
        else:
            break
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        return None
    w = inits[node.input[1]]
    return node if w.data_type == FLOAT and len(w.dims) == 2 else None


def _quantise_untied_head(proto: onnx.ModelProto, embedding: str, read: Callable[[onnx.TensorProto], np.ndarray]) -> str | None:
    """An int4 export's untied head stored as the embedding table is (``embedding``: 8 bits by default, MatMulNBits
    over ``quantise_table`` of its transposed weight, as a tied head's). Returns the head's name where it stays
    fp32 (``--embedding fp32``, or K not a multiple of the block), else None.

    Why not 4 bits like the other weights: the head turns every error before it into the logits. On a Qwen3.5 and a
    Mamba2 trained for minutes (hidden 256, untied; docs/importers.md) int4 with a 4-bit head moved held-out text by
    +0.085 and +0.092 bits/byte, with the head in 8 bits and the rest in 4 by +0.009 and +0.018 (emulated with
    edgelin.quantref, which matched the int4 graphs' +0.086 and +0.092), where the LFM2 beside them, its head tied to
    an 8-bit table, was at +0.006."""
    graph = proto.graph
    node = untied_head(graph)
    if node is None:
        return None
    w = next(i for i in graph.initializer if i.name == node.input[1])
    K = w.dims[0]
    if embedding not in EMBEDDING_BITS or K % TABLE_BLOCK:
        return node.name
    bits = EMBEDDING_BITS[embedding]
    table_heads(graph, [node], *quantise_table(read(w).T, bits), bits, f"{w.name}_head_q{bits}")
    if not any(w.name in n.input for n in graph.node):
        graph.initializer.remove(w)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return None


def weight_digest(w: np.ndarray) -> str:
    """The fingerprint by which a MatMul's weight [K, N] is found in a graph: sha256 of its float32 bytes (a
    torch Linear's weight transposed, as the graph stores it)."""
    return hashlib.sha256(np.ascontiguousarray(w, dtype=np.float32).tobytes()).hexdigest()


def eight_bit_digests(linears) -> frozenset[str]:
    """The ``weight_digest`` of each torch Linear of ``linears`` as the graph stores its weight (transposed, [K, N])."""
    return frozenset(weight_digest(linear.weight.detach().float().numpy().T) for linear in linears)


def _eight_bit_matmuls(graph: onnx.GraphProto, digests: frozenset[str], read: Callable[[onnx.TensorProto], np.ndarray]) -> list[str]:
    """The MatMuls whose constant float [K, N] weight has one of ``digests`` (``weight_digest``)."""
    if not digests:
        return []
    inits = {i.name: i for i in graph.initializer}
    found = []
    for node in graph.node:
        w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if w is not None and w.data_type == FLOAT and len(w.dims) == 2 and weight_digest(read(w)) in digests:
            found.append(node.name)
    return found


def convert_int4(proto: onnx.ModelProto, state_dtype: str, embedding: str = "int8", eight_bit: frozenset[str] = frozenset(),
                 read: Callable[[onnx.TensorProto], np.ndarray] = numpy_helper.to_array, spill: Path | None = None,
                 reuse: Reuse | None = None) -> tuple[onnx.ModelProto, Conversion]:
    """``eight_bit``: the ``weight_digest`` of each weight to store in 8-bit blocks instead (MatMulNBits, bits 8, as
    int8's block scheme): the linears a layer names in ``eight_bit_linears`` (edgelin.quantref). ``read``: an
    initializer's values. ``spill``: None, ONNX Runtime's ``MatMulNBitsQuantizer`` on the graph in memory; a file, the
    same quantisation one weight at a time, each written to it as made (``_int4_matmuls``: ``int4_file``; ``reuse``: see there)."""
    exact_head = _quantise_untied_head(proto, embedding, read)
    eight = _eight_bit_matmuls(proto.graph, eight_bit, read)
    routers = router_matmuls(proto.graph)
    exclude = ([exact_head] if exact_head else []) + eight + routers
    if spill is None:
        MatMulNBitsQuantizer = _import_leaving_logging_alone("onnxruntime.quantization.matmul_nbits_quantizer").MatMulNBitsQuantizer  # noqa: N806
        with quiet():
            quant = MatMulNBitsQuantizer(proto, bits=4, block_size=INT4_BLOCK, is_symmetric=True, op_types_to_quantize=("MatMul",),
                                         accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=exclude or None)
            quant.process()
            out = quant.model.model
    else:
        out = _int4_matmuls(proto, read, frozenset(exclude), spill, reuse)
    if eight and spill is not None:
        with Spill(out.graph, spill) as spilling:
            _quantise_matmuls(out.graph, read, "block", only=frozenset(eight), spill=spilling, reuse=reuse)
    elif eight:
        _quantise_matmuls(out.graph, read, "block", only=frozenset(eight))
    tables = quantise_embedding(out, embedding, read)
    why = {exact_head: "the head, stored as the embedding table is: " + ("--embedding fp32" if embedding == "fp32" else f"K not a multiple of {TABLE_BLOCK}")} if exact_head else {}
    why.update(dict.fromkeys(routers, ROUTER_KEPT))
    note = Conversion("int4", kept=kept_matmuls(out, f"not block-quantisable with block {INT4_BLOCK}", tables, why), eight_bit=len(eight),
                      fp32_routers=len(routers))
    return out, note


def _int4_matmuls(proto: onnx.ModelProto, read: Callable[[onnx.TensorProto], np.ndarray], exclude: frozenset[str], spill: Path,
                  reuse: Reuse | None = None) -> onnx.ModelProto:
    """What ``MatMulNBitsQuantizer`` (4 bits, symmetric, block INT4_BLOCK, QOperator) makes of ``proto``'s MatMuls with a
    constant float [K, N] weight, but never holding more than one weight: each read with ``read``, quantised by ONNX
    Runtime's own kernel (``quantize_matmul_4bits``, K zero-padded to whole blocks as the quantiser pads it), and its
    4-bit blocks and scales appended to ``spill`` and referenced from there (``save_graph`` copies them on). The same
    nodes, names, initializers and order as the quantiser's: MatMulNBits ``<node>_Q4`` reading ``<weight>_Q4`` (uint8
    [N, K / 32, 16]) and ``<weight>_scales`` (float32 [N, K / 32]); then every initializer no node reads removed, as its
    ``clean_initializers`` does. Weights of another rank or type, and ``exclude``'s nodes, are left as they are. ``reuse``:
    a weight made from a parameter in a graph saved before refers to those tensors instead (``weights.Reuse``)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    graph = proto.graph
    opset = next((o for o in proto.opset_import if o.domain == MS_DOMAIN), None)
    if opset is None:
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    else:
        opset.version = 1
    inits = {t.name: t for t in graph.initializer}
    made: dict[str, tuple[str, str]] = {}
    nodes = []
    with Spill(graph, spill) as spilling:
        for node in graph.node:
            w = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
            if node.name in exclude or w is None or w.data_type != FLOAT or len(w.dims) != 2:
                nodes.append(node)
                continue
            K, N = w.dims
            if w.name not in made:
                values = read(w)
                made[w.name] = (f"{w.name}_Q4", f"{w.name}_scales")
                key = deferred.identity(values)
                found = reuse.find(key) if reuse is not None else None
                if found is not None:  # made from the same parameter in a graph saved before: referred to there
                    for name, t in zip(made[w.name], found):
                        t.name = name
                        graph.initializer.append(t)
                    del values
                    nodes.append(_nbits_node(node, made[w.name], K, N))
                    continue
                blocks = -(-K // INT4_BLOCK)
                packed = np.zeros((N, blocks, INT4_BLOCK // 2), np.uint8)
                scales = np.zeros((N, blocks), np.float32)
                zero_points = np.zeros((N, (blocks + 1) // 2), np.uint8)
                # a slab of columns at a time (each column's blocks are its own): memory holds the slab, not the weight in
                # float32, whose values may be a view of the model's parameter in the other order (edgelin.exporters.deferred)
                whole = values.flags.c_contiguous and values.dtype == np.float32 and K % INT4_BLOCK == 0  # file pages as they are
                step = N if whole else slab_columns(blocks * INT4_BLOCK)
                for n in range(0, N, step):
                    m = min(N, n + step) - n
                    if whole:
                        slab = np.asarray(values)
                    else:
                        slab = np.zeros((blocks * INT4_BLOCK, m), np.float32)  # K padded to whole blocks with zeros
                        slab[:K] = values[:, n:n + m]
                    quantize_matmul_4bits(packed[n:n + m], slab, scales[n:n + m], zero_points[n:n + m], INT4_BLOCK, m, K, True)
                del values
                spilling.add(made[w.name][0], packed, onnx.TensorProto.UINT8)
                spilling.add(made[w.name][1], scales, FLOAT)
                if reuse is not None:
                    reuse.made(key, list(made[w.name]))
            nodes.append(_nbits_node(node, made[w.name], K, N))
    del graph.node[:]
    graph.node.extend(nodes)
    read_by = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    seen: set[str] = set()
    for i in reversed([i for i, t in enumerate(graph.initializer) if t.name not in read_by or (t.name in seen or seen.add(t.name))]):
        del graph.initializer[i]
    return proto


def _nbits_node(node: onnx.NodeProto, weights: tuple[str, str], K: int, N: int) -> onnx.NodeProto:
    return helper.make_node("MatMulNBits", [node.input[0], *weights], [node.output[0]], name=f"{node.name}_Q4" if node.name else "",
                            domain=MS_DOMAIN, K=K, N=N, bits=4, block_size=INT4_BLOCK, accuracy_level=ACCURACY_LEVEL)


def int4_file(path: Path, embedding: str = "int8", eight_bit: frozenset[str] = frozenset(), reuse: Reuse | None = None) -> tuple[onnx.ModelProto, Conversion]:
    """``convert_int4`` of the fp32 graph file ``path`` (its weights in files beside it), one weight at a time: read from
    the graph's data file, quantised, written to ``<name>.q4`` beside it (the note's ``spilled``: the export's
    ``save_graph`` adopts it as one of the graph's data files). Memory holds one weight, whatever the model's size."""
    spill = path.with_name(path.name + ".q4")
    spill.unlink(missing_ok=True)
    out, note = convert_int4(open_graph(path), "float32", embedding, eight_bit, read=lambda t: tensor_values(t, path.parent), spill=spill,
                             reuse=reuse)
    note.spilled = spill
    return out, note
