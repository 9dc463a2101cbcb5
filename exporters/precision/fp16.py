"""fp16: weights and activations in fp16 through ``onnxruntime.transformers.float16``, with the regions that must
stay in fp32 found in the graph: the running sums (``accumulator_region``), each decay's path into them
(``decay_region``), position angles (``angle_region``), norm statistics (``norm_region``) and mixture-of-experts
routers up to their choice (``router_region``); then the converter's
round trips through fp16 removed and its Casts put in order."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import numpy as np
import onnx

from edgelin.errors import ExportError
from edgelin.exporters.precision.common import FLOAT, Conversion, quiet
from edgelin.exporters.weights import open_graph
from edgelin.runtime.manifest import STATE_PREFIX

ACCUMULATORS = ("S", "z")  # state names (the part after "{layer}.") that are running sums
_STOP = {"Div"}  # the normalising division: its output is a convex mix of values, safe in fp16
_INTEGER_OPS = {"Shape", "Size"}  # read a tensor's shape, not its values: not part of the fp32 region
_ACTIVATION_OPS = {"MatMul", "Gemm", "Conv", "MatMulNBits", "Gather"}  # a tensor past one of these is not a position's


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


def router_region(graph: onnx.GraphProto) -> set[str]:
    """Names of the nodes of each mixture-of-experts router up to its choice: backward from each TopK to the router's
    MatMul (included). The choice is a comparison of scores: fp16 logits flip a near tie between two experts, and a
    token routed to another expert departs by far more than fp16's budget."""
    producer = {o: n for n in graph.node for o in n.output}
    region: set[str] = set()
    for top in (n for n in graph.node if n.op_type == "TopK"):
        region.add(top.name)
        frontier = [top.input[0]]
        while frontier:
            node = producer.get(frontier.pop())
            if node is None or node.name in region or node.op_type in _INTEGER_OPS:
                continue
            region.add(node.name)
            if node.op_type != "MatMul":
                frontier.extend(node.input)
    return region


ROUTER_KEPT = "a mixture-of-experts router: a near tie between two experts flips under its rounding, and the token then " \
              "takes another expert's output"


def router_matmuls(graph: onnx.GraphProto) -> list[str]:
    """The MatMul of each mixture-of-experts router (``router_region``'s MatMuls): int8 and int4 leave them in fp32
    (a router is d x E, a few hundred KB at most per layer; its top-k choice is a comparison that rounding flips)."""
    region = router_region(graph)
    return [n.name for n in graph.node if n.op_type == "MatMul" and n.name in region]


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
    fp32_inputs = {i.name for i in graph.input if i.type.tensor_type.elem_type == FLOAT}  # state inputs kept fp32
    for node in graph.node:  # Cast(fp32 -> fp16 -> fp32): read the fp32 source (a Cast to fp32 of fp32 is a copy)
        if node.op_type != "Cast" or _cast_to(node) != FLOAT:
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


@contextlib.contextmanager
def _value_info_from_dims(module):
    """The float16 converter makes each converted initializer's value info from its values (numpy_helper.to_array,
    for the shape alone): from its dims here, the same value info, so that an initializer still in its data file
    is not read (onnx's reader would look for it beside the current directory)."""
    original = module.make_value_info_from_tensor
    module.make_value_info_from_tensor = lambda t: onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
    try:
        yield
    finally:
        module.make_value_info_from_tensor = original


def _to_fp16(piece: bytes) -> bytes:
    """float32 bytes -> float16 bytes, as the float16 converter rounds an initializer (elementwise: piece by piece)."""
    from onnxruntime.transformers.float16 import convert_np_to_float16

    return convert_np_to_float16(np.frombuffer(piece, dtype=np.float32)).tobytes()


def convert_fp16(proto: onnx.ModelProto, state_dtype: str, embedding: str = "fp16") -> tuple[onnx.ModelProto, Conversion]:
    """``proto`` in fp16. Initializers still in the graph's data file (``fp16_file``) are left there: the converter
    changes their type, and the note's ``recast`` names the ones whose bytes ``save_graph`` converts on the way."""
    from onnxruntime.transformers import float16

    _unnamed_nodes(proto.graph)
    region = accumulator_region(proto.graph)
    decays = decay_region(proto.graph, region)
    angles = angle_region(proto.graph) - region - decays
    norms = norm_region(proto.graph) - region - decays - angles
    routers = router_region(proto.graph) - region - decays - angles - norms
    logits = proto.graph.output[0].name
    states = [i.name for i in proto.graph.input if i.name.startswith(STATE_PREFIX)] + [o.name for o in proto.graph.output[1:]]
    # the converter turns every float graph input/output it is not told to keep into fp16, and puts a
    # Cast in front of each blocked (fp32) node that reads one
    keep_io = [logits] + ([] if state_dtype == "float16" else states)
    stored = {t.name for t in proto.graph.initializer if t.data_type == FLOAT and t.data_location == onnx.TensorProto.EXTERNAL}
    with quiet(), _value_info_from_dims(float16):
        out = float16.convert_float_to_float16(proto, keep_io_types=keep_io, node_block_list=sorted(region | decays | norms | angles | routers),
                                               disable_shape_infer=False)
    _dedupe_casts(out.graph)
    _drop_round_trips(out.graph, region | decays | norms | angles | routers)
    _unnamed_nodes(out.graph)
    _toposort(out.graph)  # the converter appends its Casts at the end; onnx.checker wants producers first
    del out.graph.value_info[:]  # some intermediate types it left are stale; they are optional, ORT infers them
    recast = {t.name: _to_fp16 for t in out.graph.initializer if t.name in stored and t.data_type == onnx.TensorProto.FLOAT16}
    note = Conversion("fp16", fp32_nodes=len(region) + len(decays) + len(norms) + len(angles) + len(routers), recast=recast)
    note.kept.append(f"{len(region)} nodes of the state accumulation and normaliser (fp32: running sums outgrow fp16)")
    if decays:
        note.kept.append(f"{len(decays)} nodes of the decays' path into them, from each Softplus (fp32: fp16 log-decays, "
                         "summed over a chunk, move the decays by ~1e-2)")
    note.kept.append(f"{len(norms)} nodes of the norms' statistics (fp32: x^2 overflows fp16 for |x| > 256; L2-normalised keys "
                     "reach the delta rule as unit vectors)")
    if angles:
        note.kept.append(f"{len(angles)} nodes of the position angles and their cos / sin (fp32: fp16 angles are off by "
                         "0.5 rad at position 1,024)")
    if routers:
        note.kept.append(f"{len(routers)} nodes of the mixture-of-experts routers up to their TopK (fp32: fp16 router logits "
                         "flip near ties between experts)")
    return out, note


def fp16_file(path: Path, state_dtype: str) -> tuple[onnx.ModelProto, Conversion]:
    """``convert_fp16`` of the fp32 graph file ``path`` (its weights in files beside it), never holding its weights: they
    stay in the data file, and ``save_graph`` converts each on its way to the new one (the note's ``recast``)."""
    return convert_fp16(open_graph(path), state_dtype)
