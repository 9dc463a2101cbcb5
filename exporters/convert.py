"""A checked fp32 graph rewritten in the export's precision (``edgelin.exporters.precision``), a tied head rewritten
in place, each graph as soon as it is traced; and the manifest's record of what changed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx

from edgelin.errors import ExportError
from edgelin.exporters.precision import Conversion, embedding_choice, fp16_file, int4_file, int8_file
from edgelin.exporters.weights import Reuse, save_graph, tied_head_in_place
from edgelin.exporters.write import GRAPH_FILES
from edgelin.runtime.manifest import Manifest


def convert_graph(tmp: Path, graph: str, precision: str, state_dtype: str, say: Callable[[str], None], embedding: str | None = None,
                  int8_scheme: str | None = None, eight_bit: frozenset[str] = frozenset(), reuse: Reuse | None = None) -> Converted:
    """The checked fp32 graph ``graph`` in ``tmp`` rewritten in ``precision`` (``int8_scheme``: as ``int8_scheme_choice``
    resolved it; ``eight_bit``: int4's weights kept in 8-bit blocks, by digest), in place. Each converter reads the
    graph's weights one tensor at a time from its data file and the new one is written likewise: the float32 weights are
    never in memory. Returns what ``record_conversion`` needs, not the graph: protobuf keeps the memory of the bytes a
    message held until the message itself goes. ``reuse`` (int8, int4): shared by the export's graphs, so that a weight
    converted in one graph is referred to, not converted and written again, in the next (``weights.Reuse``)."""
    fname = GRAPH_FILES[graph]
    _check_fp32(tmp / fname, graph)
    say(f"converting the {graph} graph to {precision}" + (f" (state {state_dtype})" if precision == "fp16" else "") + " ...")
    if precision == "int8":
        proto, note = int8_file(tmp / fname, embedding_choice(precision, embedding), int8_scheme, reuse)
    elif precision == "int4":
        proto, note = int4_file(tmp / fname, embedding_choice(precision, embedding), eight_bit, reuse)
    else:
        proto, note = fp16_file(tmp / fname, state_dtype)
    tied_head_in_place(proto)
    # the converter's spill file stays, one of the graph's data files, until the store moves its tensors and removes it
    save_graph(proto, tmp / fname, note.recast, keep=reuse.files if reuse is not None else frozenset(), adopt=note.spilled)
    if reuse is not None:
        reuse.saved(proto, tmp / fname)
    return Converted(len(proto.graph.node), op_histogram(proto), note)


@dataclass(frozen=True)
class Converted:
    """One converted graph, as the manifest records it."""
    nodes: int
    op_types: dict[str, int]
    note: Conversion


def _check_fp32(path: Path, graph: str) -> None:
    """torch's graph, checked (onnx.checker, full check) before it is converted."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"the exported {graph} graph failed onnx.checker: {str(exc).splitlines()[0]}") from None


def record_conversion(converted: dict[str, Converted], precision: str, manifest: Manifest, say: Callable[[str], None],
                      embedding: str | None = None, int8_scheme: str | None = None) -> tuple[dict, dict]:
    """The manifest's extra fields for the graphs ``convert_graph`` made: node counts and what stayed in higher
    precision. Returns (nodes, op types) per graph."""
    nodes = {g: c.nodes for g, c in converted.items()}
    op_types = {g: c.op_types for g, c in converted.items()}
    kept = {g: c.note.kept for g, c in converted.items()}
    eight = max(c.note.eight_bit for c in converted.values())
    routers = max(c.note.fp32_routers for c in converted.values())
    manifest.extra.update(nodes=nodes, precision_kept=kept, state_bytes_per_sequence=manifest.state_bytes(1))
    if eight:  # validate's quantised reference stores the same linears in 8 bits (edgelin.quantref)
        manifest.extra["eight_bit_weights"] = eight
        say(f"{eight} weights whose layers read outlier inputs stored in 8-bit blocks")
    if routers:  # validate's quantised reference leaves the same routers unquantised (edgelin.quantref)
        manifest.extra["fp32_routers"] = routers
        say(f"{routers} mixture-of-experts routers kept in fp32 (their top-k choice is a comparison that rounding flips)")
    if precision == "int8":
        manifest.extra["int8_scheme"] = int8_scheme
    if precision in ("int8", "int4"):  # how the token table is stored: validate's quantised reference reads it
        manifest.extra["embedding"] = embedding_choice(precision, embedding)
    return nodes, op_types


def op_histogram(proto: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))
