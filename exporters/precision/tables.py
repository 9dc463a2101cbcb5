"""The embedding table and the tied head, block-quantised from one table (``quantise_table``): the token
embedding's Gather becomes GatherBlockQuantized and a tied head's MatMul becomes MatMulNBits on the same bytes; and
the notes of what a quantiser left in fp32 (``kept_matmuls``). Shared by int8 and int4."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgelin.exporters.precision.common import ACCURACY_LEVEL, EMBEDDING_BITS, FLOAT, MS_DOMAIN, TABLE_BLOCK


def quantise_table(w: np.ndarray, bits: int, block: int = TABLE_BLOCK, rows: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """[V, D] float -> (uint8 [V, D * bits / 8], float32 scales [V, D / block]): each block of ``block`` values
    along D scaled by its largest |value| / (2^(bits-1) - 1), rounded, stored + 2^(bits-1) (4 bits: two per
    byte, the even position in the low nibble). Rows are quantised ``rows`` at a time (a 250k table never
    has a float64 copy)."""
    V, D = w.shape
    if D % block:
        raise ValueError(f"d_model {D} is not a multiple of the block {block}")
    qmax, zero = (1 << (bits - 1)) - 1, 1 << (bits - 1)
    packed = np.empty((V, D * bits // 8), np.uint8)
    scales = np.empty((V, D // block), np.float32)
    for r in range(0, V, rows):
        b = np.asarray(w[r : r + rows], np.float32).reshape(-1, D // block, block)
        s = np.abs(b).max(-1) / qmax
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        q = (np.clip(np.rint(b / s[..., None]), -qmax - 1, qmax).astype(np.int16) + zero).astype(np.uint8).reshape(-1, D)
        packed[r : r + rows] = q if bits == 8 else q[:, 0::2] | (q[:, 1::2] << 4)
        scales[r : r + rows] = s
    return packed, scales


def dequantise_table(packed: np.ndarray, scales: np.ndarray, bits: int, block: int = TABLE_BLOCK, rows: int = 16384) -> np.ndarray:
    """``quantise_table``'s output back to float32 [V, D]: what the graph's Gather and head compute with. Rows are
    made ``rows`` at a time (nothing but the result is table-sized)."""
    V = packed.shape[0]
    zero = 1 << (bits - 1)
    out = np.empty((V, packed.shape[1] * 8 // bits), np.float32)
    for r in range(0, V, rows):
        p = packed[r : r + rows]
        if bits == 4:
            q = np.empty((p.shape[0], p.shape[1] * 2), np.uint8)
            q[:, 0::2], q[:, 1::2] = p & 0xF, p >> 4
        else:
            q = p
        out[r : r + rows] = ((q.astype(np.float32) - zero).reshape(q.shape[0], -1, block) * scales[r : r + rows, :, None]).reshape(q.shape[0], -1)
    return out


def quantise_embedding(proto: onnx.ModelProto, embedding: str,
                       read: Callable[[onnx.TensorProto], np.ndarray] = numpy_helper.to_array) -> list[tuple[str, str]]:
    """The token embedding's Gather (a constant float [V, D] table read at the graph's token ids) ->
    GatherBlockQuantized, and each tied head reading that table transposed (Transpose [1, 0] -> MatMul) ->
    MatMulNBits on the same bytes. ``read``: an initializer's values (one tensor from the graph's data file where
    the graph was opened without them). Returns (table, why) for each table left in fp32, for ``kept_matmuls``."""
    graph = proto.graph
    ids = graph.input[0].name
    inits = {i.name: i for i in graph.initializer}
    notes = []
    for node in [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits and n.input[1] == ids]:
        table = inits[node.input[0]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table.data_type != FLOAT or len(table.dims) != 2 or axis != 0:
            continue
        V, D = table.dims
        if embedding == "fp32" or D % TABLE_BLOCK:
            why = "--embedding fp32" if embedding == "fp32" else f"d_model {D} is not a multiple of the block {TABLE_BLOCK}"
            notes.append((table.name, why))
            continue
        bits = EMBEDDING_BITS[embedding]
        packed, scales = quantise_table(read(table), bits)
        base = f"{table.name}_q{bits}"
        graph.initializer.extend([numpy_helper.from_array(packed, base), numpy_helper.from_array(scales, f"{base}_scales")])
        gather = helper.make_node("GatherBlockQuantized", [base, node.input[1], f"{base}_scales"], list(node.output), name=f"{node.name}_q{bits}",
                                  domain=MS_DOMAIN, gather_axis=0, quantize_axis=1, block_size=TABLE_BLOCK, bits=bits)
        _replace(graph, node, [gather])
        for t in [n for n in graph.node if n.op_type == "Transpose" and n.input[0] == table.name]:
            perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), [1, 0])
            heads = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] == t.output[0]] if perm == [1, 0] else []
            if not heads:
                continue
            table_heads(graph, heads, packed, scales, bits, f"{base}_head")  # the same bytes as the Gather's: stored once
            if not any(t.output[0] in n.input for n in graph.node):
                graph.node.remove(t)
        if not any(table.name in n.input for n in graph.node):
            graph.initializer.remove(table)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import) and any(n.domain == MS_DOMAIN for n in graph.node):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return notes


def table_heads(graph: onnx.GraphProto, heads: list[onnx.NodeProto], packed: np.ndarray, scales: np.ndarray, bits: int, base: str) -> None:
    """Each MatMul of ``heads`` (x [.., D] -> logits [.., V]) -> MatMulNBits over the table ``quantise_table`` made
    (``packed`` [V, D * bits / 8], ``scales``), stored once under ``base``."""
    V, D = packed.shape[0], scales.size // packed.shape[0] * TABLE_BLOCK
    graph.initializer.extend([numpy_helper.from_array(packed.reshape(V, D // TABLE_BLOCK, -1), base),
                              numpy_helper.from_array(scales.reshape(-1), f"{base}_scales")])
    for m in heads:
        _replace(graph, m, [helper.make_node("MatMulNBits", [m.input[0], base, f"{base}_scales"], list(m.output), name=f"{m.name}_q{bits}",
                                             domain=MS_DOMAIN, K=D, N=V, bits=bits, block_size=TABLE_BLOCK, accuracy_level=ACCURACY_LEVEL)])


def _replace(graph: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
    """``node`` replaced in place (same position: the graph stays topologically sorted) by ``new``."""
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for k, n in enumerate(new):
        graph.node.insert(at + k, n)


def _weights_by_matmul(proto: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(MatMul nodes with a constant weight, MatMul nodes without one)."""
    inits = {i.name for i in proto.graph.initializer}
    const, other = [], []
    for node in proto.graph.node:
        if node.op_type == "MatMul":
            (const if node.input[1] in inits else other).append(node.name)
    return const, other


def _tied_tables(proto: onnx.ModelProto) -> dict[str, str]:
    """Transpose outputs that are a Gather's constant table transposed (a tied head's weight) -> the table."""
    inits = {i.name for i in proto.graph.initializer}
    tables = {n.input[0] for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits}
    return {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in tables}


def kept_matmuls(proto: onnx.ModelProto, why: str, tables: Iterable[tuple[str, str]] = (), reasons: dict[str, str] | None = None) -> list[str]:
    """MatMuls a quantiser left in fp32, each with the reason (``reasons`` by node name, else ``why``), then
    ``tables`` (the embedding tables ``quantise_embedding`` kept, with why), each said to be shared with a tied head
    only where the graph does read it as one, then any other constant float table a Gather reads."""
    const, other = _weights_by_matmul(proto)
    tied = _tied_tables(proto)
    inputs = {n.name: n.input[1] for n in proto.graph.node if n.op_type == "MatMul"}
    kept = [f"MatMul {n} (fp32: {(reasons or {}).get(n, why)})" for n in const]
    kept += [f"MatMul {n} (fp32: " + ("the tied head: its weight is the embedding, transposed in the graph)" if inputs[n] in tied
                                     else "no constant weight: a product of two computed tensors, e.g. with the state)") for n in other]
    inits = {i.name for i in proto.graph.initializer}
    noted = set()
    for table, reason in tables:
        noted.add(table)
        kept.append(f"embedding Gather {table} (fp32: {reason}" + ("; shared with the tied head)" if table in tied.values() else ")"))
    for table in sorted({n.input[0] for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits and _is_float(proto, n.input[0])} - noted):
        kept.append(f"Gather {table} (fp32: a table other than the token embedding, not quantised)")
    return kept


def _is_float(proto: onnx.ModelProto, name: str) -> bool:
    return any(i.name == name and i.data_type == onnx.TensorProto.FLOAT for i in proto.graph.initializer)
