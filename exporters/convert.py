"""The checked fp32 graphs rewritten in the export's precision (``edgelin.exporters.precision``), a tied head
rewritten in place, and the manifest's record of what changed."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import onnx

from edgelin.exporters.precision import embedding_choice, fp16_file, int4_file, int8_file
from edgelin.exporters.weights import save_graph, tied_head_in_place
from edgelin.exporters.write import GRAPH_FILES
from edgelin.runtime.manifest import Manifest


def convert_graphs(tmp: Path, precision: str, state_dtype: str, manifest: Manifest, say: Callable[[str], None], embedding: str | None = None,
                    int8_scheme: str | None = None, eight_bit: frozenset[str] = frozenset()) -> tuple[dict, dict]:
    """The checked fp32 graphs in ``tmp`` rewritten in ``precision`` (``int8_scheme``: as ``int8_scheme_choice``
    resolved it; ``eight_bit``: int4's weights kept in 8-bit blocks, by digest); the manifest's extra fields record
    the node counts and what stayed in higher precision. Returns (nodes, op types) per graph."""
    say(f"converting the graphs to {precision}" + (f" (state {state_dtype})" if precision == "fp16" else "") + " ...")
    nodes, op_types, kept, eight, routers = {}, {}, {}, 0, 0
    for graph, fname in GRAPH_FILES.items():
        # each reads its graph's weights one tensor at a time from the data file and writes the new one likewise:
        # the fp32 weights are never in memory
        if precision == "int8":
            proto, note = int8_file(tmp / fname, embedding_choice(precision, embedding), int8_scheme)
        elif precision == "int4":
            proto, note = int4_file(tmp / fname, embedding_choice(precision, embedding), eight_bit)
        else:
            proto, note = fp16_file(tmp / fname, state_dtype)
        tied_head_in_place(proto)
        save_graph(proto, tmp / fname, note.recast)
        nodes[graph], op_types[graph], kept[graph] = len(proto.graph.node), op_histogram(proto), note.kept
        eight, routers = max(eight, note.eight_bit), max(routers, note.fp32_routers)
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
