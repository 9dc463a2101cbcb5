"""fp32 graphs -> fp16, int8 or int4 graphs: the post-processing behind ``edgelin export --precision``.

The exporter traces the model in fp32 and checks the graphs; this module then rewrites each graph with
ONNX Runtime's own tooling and writes by hand only the choice of what stays in fp32:

    fp32   the traced graphs, unchanged
    fp16   weights and activations in fp16 (``onnxruntime.transformers.float16``). The recurrent state
           S, the denominator z and everything computed from them up to the normalising division stay
           in fp32 (they are running sums: |z| grows linearly with the tokens read and passes fp16's
           65504 after some tens of thousands of tokens), as do the prefill's cumulative sums over
           chunks and each decay's path into them from its Softplus (``decay_region``). Graph state IO is fp32; ``state_dtype="float16"`` stores the float states as fp16
           between steps (the sums are still formed in fp32, then rounded for storage).
    int8   (scheme "channel", the default) per-channel int8 weights for every MatMul with a constant weight (the numbers and graph pattern of
           ``onnxruntime.quantization.quantize_dynamic``, computed here one weight at a time read from the graph's
           data file: ``int8_file``); activations are quantised at run time, one
           scale per tensor. Weights use 7 of the 8 bits (``reduce_range``, values in [-64, 64]): ONNX
           Runtime's u8 x s8 kernel on x86 CPUs without VNNI (AVX2 only) adds pairs of products in int16
           and saturates for full-range weights. Measured on an AVX2-only AMD EPYC, the tiny test model's
           prefill logits against fp32: rel L2 0.68 with full-range weights, 0.063 with reduce_range
           (0.049 with u8 weights, a kernel fewer runtimes have); with VNNI or on ARM the two agree. An
           export is made once and run on many CPUs, so it takes the range that is right on all of them.
           Scheme "block" (``int8_scheme``): the same weights block-quantised along K, 8 bits, block 32, one scale
           per block (llama.cpp's Q8_0), as MatMulNBits with int8 activations per block (accuracy_level 4): the
           activations get a scale per 32 values instead of one per tensor, so an outlier no longer costs a whole
           tensor its resolution (INT8_SCHEMES says what it costs).
    int4   4-bit symmetric block-quantised weights, block 32 (``MatMulNBitsQuantizer``: MatMulNBits, the
           op onnxruntime-genai runs on CPU), computing with int8 activations per block (accuracy_level 4,
           ACCURACY_LEVEL); every other op in fp32.

Embedding and tied head (int8, int4): a vocabulary of 250k at d_model 1024 is a quarter of a billion weights,
read by the token embedding's Gather (rows) and, in a tied model, transposed by the head's MatMul. Both are
block-quantised from one table (``quantise_table``: symmetric, block 32 along d_model, stored unsigned with
zero point 2^(bits-1), the layout ONNX Runtime's com.microsoft MatMulNBits and GatherBlockQuantized read):
the Gather becomes GatherBlockQuantized and a tied head's Transpose + MatMul becomes MatMulNBits on the same
bytes, which the weights file stores once. The table is 8-bit by default in both precisions (``embedding``:
"int8"; "int4" for the smallest files, "fp32" to keep it exact; see DEFAULT_EMBEDDING for why 8). An untied
head is a MatMul with a constant weight like any other in int8; in int4 it is stored as the table is (8-bit by
default: ``_quantise_untied_head`` says why). A d_model that is not a multiple of the block keeps the table in
fp32, said in the notes. The logits output stays fp32 in every precision.

``convert(proto, precision, state_dtype=...)`` returns the new graph and ``Conversion`` notes (what was
kept in higher precision and why); ``state_dtypes`` gives the manifest's state dtypes.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgelin.errors import ExportError
from edgelin.runtime.manifest import STATE_PREFIX, StateSpec

PRECISIONS = ("fp32", "fp16", "int8", "int4")
STATE_DTYPES = ("float32", "float16")
ACCUMULATORS = ("S", "z")  # state names (the part after "{layer}.") that are running sums
INT4_BLOCK = 32
TABLE_BLOCK = 32  # the embedding table's quantisation block (along d_model), int8 and int4
EMBEDDING_BITS = {"int8": 8, "int4": 4}
EMBEDDINGS = ("int8", "int4", "fp32")  # how an int8/int4 export stores the token embedding and a tied head
# int8 for both quantised precisions: on the bundled model (int4 export, validate seed 0, --long 1000) a 4-bit
# table moved the held-out bits/byte delta +0.0053 -> +0.0061, greedy agreement 52.5 -> 37.7 % and the long
# stream's rel L2 0.42 -> 1.2 (out of the int4 budget), while an 8-bit one matched the fp32 table (+0.0050,
# 52.5 %, 0.42); "int4" stays a choice for the smallest files
DEFAULT_EMBEDDING = "int8"
# int8's weight schemes. channel: MatMulInteger on per-channel weights, each activation tensor quantised with one scale
# (DynamicQuantizeLinear). block: MatMulNBits, 8 bits, block INT8_BLOCK. Measured (AVX2, ONNX Runtime 1.31; README,
# "Edge precision"): the bundled model's held-out prefill logits against fp32 rel L2 0.0040 (block) vs 0.0256
# (channel), decode level, prefill 4,096 tokens 0.59x; a random-init LFM2-350M (docs/bench/llamacpp-lfm2-350m-int8-
# block.json, 2 threads): forced top-1 vs transformers 81 % vs 56 %, decode 56 vs 46 tokens/s, prefill 4,096 209 vs
# 257 tokens/s, 399 vs 366 MB. channel stays the default for edgelin's own and fla checkpoints (the faster prefill;
# their exports keep their numbers). A transformers checkpoint defaults to block (DEFAULT_INT8_SCHEMES): trained
# hybrids carry activations one scale per tensor cannot resolve. Measured on three checkpoints trained for minutes
# (scripts/train_hf_tiny.py, docs/importers.md): per-channel int8 failed validate in LFM2, Qwen3.5 and Mamba2 (6-9
# checks each: logits, states, greedy), block passed in all three.
INT8_SCHEMES = ("channel", "block")
DEFAULT_INT8_SCHEME = "channel"
DEFAULT_INT8_SCHEMES = {"transformers": "block"}  # framework of the checkpoint (edgelin.upstream.framework_of) -> scheme
INT8_BLOCK = 32
# MatMulNBits' accuracy_level for the quantised table's head and every int4 MatMul: 4, activations quantised to
# int8 per block, integer products. ONNX Runtime 1.31's CPU kernel for 8-bit weights with fp32 activations (levels
# 0, 1) is a slow path: a 65,536 x 1,024 head took 551 ms per decode step against 5.0 ms at level 4 (2 threads, AVX2;
# 4-bit: 14.0 ms at level 0, 2.8 ms at level 4). On the bundled model's int4 export (1 thread, median of 200 decode
# steps, 3 interleaved rounds): 0.64-0.76 ms per token against 1.20-1.91 ms at level 0; validate seed 0 --long 1000:
# held-out delta +0.0052 (+0.0050), greedy 53.3 % (52.5 %), the long stream's rel L2 0.42 (0.42); prefill and
# decode then differ by rel L2 1.4e-2 (the activations are quantised per call), within the int4 budget.
ACCURACY_LEVEL = 4
MS_DOMAIN = "com.microsoft"
_STOP = {"Div"}  # the normalising division: its output is a convex mix of values, safe in fp16
_INTEGER_OPS = {"Shape", "Size"}  # read a tensor's shape, not its values: not part of the fp32 region
_ACTIVATION_OPS = {"MatMul", "Gemm", "Conv", "MatMulNBits", "Gather"}  # a tensor past one of these is not a position's
_FLOAT = onnx.TensorProto.FLOAT


@dataclass
class Conversion:
    precision: str
    kept: list[str] = field(default_factory=list)  # "what (why)": tensors/nodes left in higher precision
    fp32_nodes: int = 0  # fp16: nodes kept in fp32 (the accumulator region)


def check_precision(precision: str, state_dtype: str = "float32") -> None:
    if precision not in PRECISIONS:
        raise ExportError(f"precision {precision!r} is not supported; choose one of {', '.join(PRECISIONS)}")
    if state_dtype not in STATE_DTYPES:
        raise ExportError(f"state dtype {state_dtype!r} is not supported; choose one of {', '.join(STATE_DTYPES)}")
    if state_dtype != "float32" and precision != "fp16":
        raise ExportError(f"a {state_dtype} state needs --precision fp16 (got {precision}); drop --state-dtype")


def state_dtypes(specs: Iterable[StateSpec], precision: str, state_dtype: str = "float32") -> tuple[StateSpec, ...]:
    """The manifest's states for this precision: float states take ``state_dtype`` (fp16 exports only)."""
    check_precision(precision, state_dtype)
    return tuple(replace(s, dtype=state_dtype) if s.dtype == "float32" else s for s in specs)


def accumulator_region(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes that carry the running sums: everything reachable from an accumulator state
    input (S, z) or from a CumSum, up to and including the normalising Div; shape reads excluded."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    sources = [i.name for i in graph.input if i.name.startswith(STATE_PREFIX) and i.name.rsplit(".", 1)[-1] in ACCUMULATORS]
    region = {n.name for n in graph.node if n.op_type == "CumSum"}
    frontier = sources + [o for n in graph.node if n.op_type == "CumSum" for o in n.output]
    while frontier:
        tensor = frontier.pop()
        for node in consumers.get(tensor, []):
            if node.op_type in _INTEGER_OPS or (node.name in region and node.op_type != "CumSum"):
                continue
            if node.op_type == "CumSum" and tensor in sources:
                continue
            region.add(node.name)
            if node.op_type not in _STOP:
                frontier.extend(node.output)
    return region


def decay_region(graph: onnx.GraphProto, accumulators: set[str]) -> set[str]:
    """Names of the nodes of each decay's path into the running sums: from a Softplus (the step size of Mamba2's
    and Gated DeltaNet's decays, log-sigmoid gates, the softplus feature map) forward to the accumulator region
    (``accumulators``, not included), through the decays' CumSum and Exp and no further. A log-decay rounded to
    fp16 is off by ~5e-4 of itself; summed over a chunk and exponentiated, that moves the decays by ~1e-2
    (measured: a Mamba2 of hidden 256, 4 layers: fp16 prefill logits max rel 9.2e-3 -> 4.8e-3 with this path in fp32)."""
    producers = {name: node for node in graph.node for name in node.output}
    ahead = _forward_from(graph, "Softplus", stop={"CumSum", "Exp"}, exclude=accumulators)
    feeding, frontier = set(), [name for node in graph.node if node.name in accumulators for name in node.input]
    while frontier:  # the nodes the accumulator region reads from, directly or not
        node = producers.get(frontier.pop())
        if node is None or node.name in feeding or node.name in accumulators:
            continue
        feeding.add(node.name)
        frontier.extend(node.input)
    return ahead & feeding


def angle_region(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes that compute position angles and their Cos / Sin (RoPE, cosFormer's reweighting): from
    each Cos and Sin back to the positions' Cast to float (included) and the constants they are multiplied by.
    fp16 has 11 significant bits: position x frequency at 1,024 is off by up to 0.5 rad, at 16,384 by 8 rad, and the
    rotation is lost (measured: an LFM2 of hidden 256, fp16, its attention key cache after 16,384 tokens at rel L2
    0.44 against float64, the logits still within their budget). A Cos / Sin of anything a MatMul computed is not
    a position's and is left alone."""
    producers = {name: node for node in graph.node for name in node.output}
    region: set[str] = set()
    for trig in (n for n in graph.node if n.op_type in ("Cos", "Sin")):
        path, frontier, positional = {trig.name}, list(trig.input), True
        while frontier and positional:
            node = producers.get(frontier.pop())
            if node is None or node.name in path:  # a graph input, an initializer, or seen
                continue
            if node.op_type in _ACTIVATION_OPS:
                positional = False
                continue
            path.add(node.name)
            if node.op_type != "Cast" and node.op_type not in _INTEGER_OPS:  # the Cast of the positions starts the path
                frontier.extend(node.input)
        if positional:
            region |= path
    return region


def norm_region(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes of each norm's statistic: an RMS norm's from its Pow (x^2), an L2 norm's from its x * x
    summed (Gated DeltaNet's q and k, fla's l2norm), to the Reciprocal / Div of the root. x^2 overflows fp16 once
    |x| > 256 (a guard: the bundled model's residual stream stayed below that in the streams measured, the running
    sums did not, see _drop_round_trips). The L2 norm's Div in fp32 hands the delta rule's fp32 region keys of norm 1
    to fp32's precision: the state is multiplied by (I - beta k k^T) at every token, and keys rounded to fp16 (norm
    off by ~1e-4) moved a Qwen3.5's prefill logits (hidden 256, 4 layers) from rel L2 3.0e-3 to 6.6e-3."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    def statistic(node: onnx.NodeProto) -> bool:  # x^2, or x * x read only by a sum or mean
        if node.op_type == "Pow":
            return True
        readers = consumers.get(node.output[0], [])
        return (node.op_type == "Mul" and node.input[0] == node.input[1] and bool(readers)
                and all(r.op_type in ("ReduceSum", "ReduceMean") for r in readers))

    return _forward_from(graph, statistic, stop={"Reciprocal", "Div", "Mul"})


def _forward_from(graph: onnx.GraphProto, start: str | Callable[[onnx.NodeProto], bool], *, stop: set[str],
                  exclude: set[str] = frozenset()) -> set[str]:
    """Names of every node ``start`` names (an op type, or a test of the node) and of the nodes reachable forward
    from them, never entering ``exclude`` or a shape read, and not going past a node whose type is in ``stop``
    (which is included)."""
    starts = [n for n in graph.node if (n.op_type == start if isinstance(start, str) else start(n))]
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    region = {node.name for node in starts}
    frontier = [name for node in starts for name in node.output]
    while frontier:
        for node in consumers.get(frontier.pop(), []):
            if node.name in region or node.name in exclude or node.op_type in _INTEGER_OPS:
                continue
            region.add(node.name)
            if node.op_type not in stop:
                frontier.extend(node.output)
    return region


def _unnamed_nodes(graph: onnx.GraphProto) -> None:
    """The float16 converter blocks nodes by name: give every node a unique one."""
    seen: set[str] = set()
    for i, node in enumerate(graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)


def _dedupe_casts(graph: onnx.GraphProto) -> None:
    """The float16 converter names its Casts after the tensor they cast; a tensor read by two blocked nodes
    gets two identical Casts defining one name. Keep the first of each identical pair."""
    defined: dict[str, tuple] = {}
    keep = []
    for node in graph.node:
        sig = (node.op_type, tuple(node.input), tuple(a.SerializeToString() for a in node.attribute))
        clash = [o for o in node.output if o in defined]
        if clash and node.op_type == "Cast" and all(defined[o] == sig for o in clash) and len(clash) == len(node.output):
            continue
        if clash:
            raise ExportError(f"the fp16 conversion defined {clash[0]!r} twice; export in fp32 and report this model")
        defined.update((o, sig) for o in node.output)
        keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)


def _drop_round_trips(graph: onnx.GraphProto, blocked: set[str]) -> None:
    """The float16 converter casts each blocked node's output to fp16 and back to fp32 for the next blocked
    node: a round trip through fp16 that overflows exactly the running sums the block protects (measured:
    the normaliser's numerator reached 7e4 after ~450 tokens). It does the same to the fp32 state inputs
    (S, z) on their way to the blocked nodes that read them (measured: non-finite logits from ~9k tokens on
    the tiny test model and between 10k and 100k on the bundled model, once |z| or |S| passed 65504). Read
    the fp32 value directly instead."""
    producer = {o: n for n in graph.node for o in n.output}
    fp32_inputs = {i.name for i in graph.input if i.type.tensor_type.elem_type == _FLOAT}  # state inputs kept fp32
    for node in graph.node:  # Cast(fp32 -> fp16 -> fp32): read the fp32 source (a Cast to fp32 of fp32 is a copy)
        if node.op_type != "Cast" or _cast_to(node) != _FLOAT:
            continue
        down = producer.get(node.input[0])
        if down is None or down.op_type != "Cast" or _cast_to(down) != onnx.TensorProto.FLOAT16:
            continue
        src = producer.get(down.input[0])
        if (src is not None and src.name in blocked) or down.input[0] in fp32_inputs:
            node.input[0] = down.input[0]
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    keep = [n for n in graph.node if not (n.op_type == "Cast" and all(o not in used for o in n.output))]
    del graph.node[:]
    graph.node.extend(keep)


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), -1)


def _toposort(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after the producers of its inputs (stable: keeps the order otherwise)."""
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for node in pending:
            if all(name in ready for name in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):
            raise ExportError(f"the converted graph has a cycle or an undefined input at node {rest[0].name!r}; export in fp32 and report this model")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


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


def _kept_matmuls(proto: onnx.ModelProto, why: str, tables: Iterable[tuple[str, str]] = (), reasons: dict[str, str] | None = None) -> list[str]:
    """MatMuls a quantiser left in fp32, each with the reason (``reasons`` by node name, else ``why``), then
    ``tables`` (the embedding tables ``_quantise_embedding`` kept, with why), each said to be shared with a tied head
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


@contextlib.contextmanager
def _quiet():
    """ORT's quantisers log per-node progress and warn about pre-processing; keep the terminal ours."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


# ---- the converters ------------------------------------------------------------------------------
def _fp32(proto: onnx.ModelProto, state_dtype: str, embedding: str = "fp32") -> tuple[onnx.ModelProto, Conversion]:
    return proto, Conversion("fp32")


def _fp16(proto: onnx.ModelProto, state_dtype: str, embedding: str = "fp16") -> tuple[onnx.ModelProto, Conversion]:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    _unnamed_nodes(proto.graph)
    region = accumulator_region(proto.graph)
    decays = decay_region(proto.graph, region)
    angles = angle_region(proto.graph) - region - decays
    norms = norm_region(proto.graph) - region - decays - angles
    logits = proto.graph.output[0].name
    states = [i.name for i in proto.graph.input if i.name.startswith(STATE_PREFIX)] + [o.name for o in proto.graph.output[1:]]
    # the converter turns every float graph input/output it is not told to keep into fp16, and puts a
    # Cast in front of each blocked (fp32) node that reads one
    keep_io = [logits] + ([] if state_dtype == "float16" else states)
    with _quiet():
        out = convert_float_to_float16(proto, keep_io_types=keep_io, node_block_list=sorted(region | decays | norms | angles), disable_shape_infer=False)
    _dedupe_casts(out.graph)
    _drop_round_trips(out.graph, region | decays | norms | angles)
    _unnamed_nodes(out.graph)
    _toposort(out.graph)  # the converter appends its Casts at the end; onnx.checker wants producers first
    del out.graph.value_info[:]  # some intermediate types it left are stale; they are optional, ORT infers them
    note = Conversion("fp16", fp32_nodes=len(region) + len(decays) + len(norms) + len(angles))
    note.kept.append(f"{len(region)} nodes of the state accumulation and normaliser (fp32: running sums outgrow fp16)")
    if decays:
        note.kept.append(f"{len(decays)} nodes of the decays' path into them, from each Softplus (fp32: fp16 log-decays, "
                         "summed over a chunk, move the decays by ~1e-2)")
    note.kept.append(f"{len(norms)} nodes of the norms' statistics (fp32: x^2 overflows fp16 for |x| > 256; L2-normalised keys "
                     "reach the delta rule as unit vectors)")
    if angles:
        note.kept.append(f"{len(angles)} nodes of the position angles and their cos / sin (fp32: fp16 angles are off by "
                         "0.5 rad at position 1,024)")
    return out, note


# ---- the embedding table and the tied head ------------------------------------------------------
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


def dequantise_table(packed: np.ndarray, scales: np.ndarray, bits: int, block: int = TABLE_BLOCK) -> np.ndarray:
    """``quantise_table``'s output back to float32 [V, D]: what the graph's Gather and head compute with."""
    V = packed.shape[0]
    if bits == 4:
        q = np.empty((V, packed.shape[1] * 2), np.uint8)
        q[:, 0::2], q[:, 1::2] = packed & 0xF, packed >> 4
    else:
        q = packed
    zero = 1 << (bits - 1)
    return ((q.astype(np.float32) - zero).reshape(V, -1, block) * scales[..., None]).reshape(V, -1)


def _quantise_embedding(proto: onnx.ModelProto, embedding: str) -> list[tuple[str, str]]:
    """The token embedding's Gather (a constant float [V, D] table read at the graph's token ids) ->
    GatherBlockQuantized, and each tied head reading that table transposed (Transpose [1, 0] -> MatMul) ->
    MatMulNBits on the same bytes. Returns (table, why) for each table left in fp32, for ``_kept_matmuls``."""
    graph = proto.graph
    ids = graph.input[0].name
    inits = {i.name: i for i in graph.initializer}
    notes = []
    for node in [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits and n.input[1] == ids]:
        table = inits[node.input[0]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table.data_type != _FLOAT or len(table.dims) != 2 or axis != 0:
            continue
        V, D = table.dims
        if embedding == "fp32" or D % TABLE_BLOCK:
            why = "--embedding fp32" if embedding == "fp32" else f"d_model {D} is not a multiple of the block {TABLE_BLOCK}"
            notes.append((table.name, why))
            continue
        bits = EMBEDDING_BITS[embedding]
        packed, scales = quantise_table(numpy_helper.to_array(table), bits)
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
            _table_heads(graph, heads, packed, scales, bits, f"{base}_head")  # the same bytes as the Gather's: stored once
            if not any(t.output[0] in n.input for n in graph.node):
                graph.node.remove(t)
        if not any(table.name in n.input for n in graph.node):
            graph.initializer.remove(table)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import) and any(n.domain == MS_DOMAIN for n in graph.node):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return notes


def _table_heads(graph: onnx.GraphProto, heads: list[onnx.NodeProto], packed: np.ndarray, scales: np.ndarray, bits: int, base: str) -> None:
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


def _int8(proto: onnx.ModelProto, state_dtype: str, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME) -> tuple[onnx.ModelProto, Conversion]:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.onnx"
        onnx.save(proto, str(src), save_as_external_data=True, location="in.onnx.data")  # no 2 GB limit
        return int8_file(src, embedding, scheme)


def int8_file(path: Path, embedding: str = "int8", scheme: str = DEFAULT_INT8_SCHEME) -> tuple[onnx.ModelProto, Conversion]:
    """``_int8`` of the fp32 graph file ``path`` (its weights in files beside it), read one weight at a time: the
    graph in memory holds the int8 weights and what stays in fp32, never the fp32 weights beside a quantiser's own
    copies (ONNX Runtime's ``quantize_dynamic`` held ~3x the weights, and needed them loaded beside it).
    Scheme "channel": quantize_dynamic's numbers (MatMul, per channel, reduce_range, QInt8: ``_quantise_matmuls``);
    the tests hold the two to bit equality. Scheme "block": MatMulNBits, 8 bits, block INT8_BLOCK."""
    int8_scheme_choice("int8", scheme)
    proto = onnx.load(str(path), load_external_data=False)
    _quantise_matmuls(proto.graph, lambda t: _read_tensor(t, path.parent), scheme)
    for t in proto.graph.initializer:  # what stays in fp32 (the embedding, norms, ...), into memory
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t.CopyFrom(numpy_helper.from_array(_read_tensor(t, path.parent), t.name))
    tables = _quantise_embedding(proto, embedding)
    note = Conversion("int8", kept=_kept_matmuls(proto, "its weight is not a float [K, N] constant", tables))
    return proto, note


_INT8_STEP = 128.0  # reduce_range's int8 range, [-64, 64], as quantize_dynamic computes a symmetric scale over it


def _read_tensor(t: onnx.TensorProto, base: Path) -> np.ndarray:
    """An initializer's values, from the external-data file beside the graph (one tensor read) or inline."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    from edgelin.exporters.weights import read_external

    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    return np.frombuffer(read_external(t, base), dtype=dtype).reshape(tuple(t.dims))


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


def _quantise_matmuls(graph: onnx.GraphProto, read: Callable[[onnx.TensorProto], np.ndarray], scheme: str = DEFAULT_INT8_SCHEME) -> None:
    """Each MatMul of ``graph`` whose weight (input 1) is a float [K, N] initializer -> int8. Scheme "channel":
    quantize_dynamic's pattern: DynamicQuantizeLinear of the activation (one per activation, shared by its
    MatMuls), MatMulInteger on the int8 weight, Cast, and a Mul by the two scales. Scheme "block": one MatMulNBits
    (``quantise_int8_blocks``). A weight is read (``read``) and quantised once; one that no other node reads is
    dropped."""
    inits = {t.name: t for t in graph.initializer}
    targets = [n for n in graph.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") and n.input[1] in inits
               and inits[n.input[1]].data_type == _FLOAT and len(inits[n.input[1]].dims) == 2 and n.input[0] not in inits]
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
            graph.initializer.append(helper.make_tensor(names[1], _FLOAT, scale.shape, scale.tolist()))
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
                helper.make_node("Cast", [acc], [cast], to=_FLOAT, name=fresh(f"{node.name}_cast")),
                helper.make_node("Mul", [cast, both], [out], name=fresh(f"{node.name}_output_scale_mul"))]
        replace[id(node)] = new
    nodes = [m for n in graph.node for m in replace.get(id(n), [n])]
    del graph.node[:]
    graph.node.extend(nodes)
    still = {v for n in graph.node for v in n.input} | {o.name for o in graph.output}
    for i in reversed(range(len(graph.initializer))):  # in place: the others are not copied
        if graph.initializer[i].name in weights and graph.initializer[i].name not in still:
            del graph.initializer[i]


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
    tied head reads the embedding transposed; a model whose logits come otherwise)."""
    inits = {i.name: i for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    node = producer.get("logits")  # the exporter names it so (exporters/graphs.py: LOGITS)
    while node is not None and node.op_type in ("Identity", "Reshape", "Cast", "Squeeze", "Unsqueeze"):
        node = producer.get(node.input[0])
    if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
        return None
    w = inits[node.input[1]]
    return node if w.data_type == _FLOAT and len(w.dims) == 2 else None


def _quantise_untied_head(proto: onnx.ModelProto, embedding: str) -> str | None:
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
    _table_heads(graph, [node], *quantise_table(numpy_helper.to_array(w).T, bits), bits, f"{w.name}_head_q{bits}")
    if not any(w.name in n.input for n in graph.node):
        graph.initializer.remove(w)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return None


def _int4(proto: onnx.ModelProto, state_dtype: str, embedding: str = "int8") -> tuple[onnx.ModelProto, Conversion]:
    MatMulNBitsQuantizer = _import_leaving_logging_alone("onnxruntime.quantization.matmul_nbits_quantizer").MatMulNBitsQuantizer  # noqa: N806

    exact_head = _quantise_untied_head(proto, embedding)
    with _quiet():
        quant = MatMulNBitsQuantizer(proto, bits=4, block_size=INT4_BLOCK, is_symmetric=True, op_types_to_quantize=("MatMul",),
                                     accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=[exact_head] if exact_head else None)
        quant.process()
        out = quant.model.model
    tables = _quantise_embedding(out, embedding)
    why = {exact_head: "the head, stored as the embedding table is: " + ("--embedding fp32" if embedding == "fp32" else f"K not a multiple of {TABLE_BLOCK}")} if exact_head else {}
    note = Conversion("int4", kept=_kept_matmuls(out, f"not block-quantisable with block {INT4_BLOCK}", tables, why))
    return out, note


CONVERTERS: dict[str, Callable[..., tuple[onnx.ModelProto, Conversion]]] = {
    "fp32": _fp32, "fp16": _fp16, "int8": _int8, "int4": _int4,
}


def convert(proto: onnx.ModelProto, precision: str, *, state_dtype: str = "float32", embedding: str | None = None,
            int8_scheme: str | None = None) -> tuple[onnx.ModelProto, Conversion]:
    """One fp32 graph (prefill or decode, as the exporter writes it) in ``precision``. ``embedding``: how an
    int8 or int4 export stores the token embedding and a tied head ("int8" by default, "int4", "fp32";
    ``embedding_choice``). ``int8_scheme``: int8's weights, "channel" (the default) or "block" (INT8_SCHEMES)."""
    check_precision(precision, state_dtype)
    scheme = int8_scheme_choice(precision, int8_scheme)
    extra = {"scheme": scheme} if scheme else {}
    return CONVERTERS[precision](proto, state_dtype, embedding_choice(precision, embedding), **extra)


def int8_scheme_choice(precision: str, scheme: str | None, framework: str | None = None) -> str | None:
    """The int8 weight scheme for ``precision`` (None: the default for a checkpoint of ``framework``, None for
    edgelin's own: DEFAULT_INT8_SCHEMES, else DEFAULT_INT8_SCHEME; None for other precisions); ExportError for a
    scheme that is not known or does not apply."""
    if precision != "int8":
        if scheme is not None:
            raise ExportError(f"--int8-scheme applies to int8 exports only (this one is {precision}); drop it or pass --precision int8")
        return None
    if scheme is None:
        return DEFAULT_INT8_SCHEMES.get(framework or "", DEFAULT_INT8_SCHEME)
    if scheme not in INT8_SCHEMES:
        raise ExportError(f"int8 scheme {scheme!r} is not known; choose one of {', '.join(INT8_SCHEMES)}")
    return scheme


def embedding_choice(precision: str, embedding: str | None) -> str:
    """The embedding storage for ``precision`` (None: the default); ExportError for one that does not apply."""
    if precision not in ("int8", "int4"):
        if embedding is not None:
            raise ExportError(f"--embedding applies to int8 and int4 exports; a {precision} export stores the embedding in {precision}")
        return precision
    if embedding is None:
        return DEFAULT_EMBEDDING
    if embedding not in EMBEDDING_BITS and embedding != "fp32":
        raise ExportError(f"embedding storage {embedding!r} is not known; choose one of {', '.join(EMBEDDINGS)}")
    return embedding


__all__ = ["ACCUMULATORS", "CONVERTERS", "Conversion", "DEFAULT_INT8_SCHEME", "DEFAULT_INT8_SCHEMES", "INT4_BLOCK", "INT8_BLOCK", "INT8_SCHEMES", "PRECISIONS", "STATE_DTYPES", "DEFAULT_EMBEDDING", "EMBEDDINGS", "TABLE_BLOCK", "accumulator_region", "angle_region",
           "check_precision", "convert", "dequantise_table", "embedding_choice", "int8_file", "int8_scheme_choice", "quantise_int8_blocks", "quantise_int8_columns", "quantise_table", "state_dtypes"]
