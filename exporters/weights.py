"""Weights stored once: both graphs of an export read their weights from one external-data file.

ONNX external data lets an initializer live outside the graph file, at an offset of a named file. The exporter
writes each graph with its weights beside it (``prefill.onnx.data``: torch.onnx and the precision converters
work graph by graph, and protobuf cannot hold a graph over 2 GB), then ``store_once`` moves every initializer
of at least ``MIN_BYTES`` of both graphs into ``weights.data``: a tensor both graphs hold (the embedding, every
projection) is written once and both graphs point at the same bytes. Small initializers (shapes, scalars,
masks) stay inside the graph, where they are readable.

Offsets of tensors of ``PAGE`` bytes or more are multiples of ``PAGE`` (64 KiB: the allocation granularity of
Windows, a multiple of Linux's 4 KiB pages) so that ONNX Runtime can memory-map them from the file instead of
copying them; smaller tensors are aligned to 64 bytes.

Only one graph's weights are in memory at a time: peak memory is that of the larger graph, not of both.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import onnx
from onnx.external_data_helper import set_external_data

from edgelin.errors import ExportError

WEIGHTS_FILE = "weights.data"
MIN_BYTES = 1024  # smaller initializers stay inside the graph
PAGE = 64 << 10
SMALL_ALIGN = 64


def initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer of ``graph`` and of the graphs nested in its nodes' attributes."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from initializers(attr.g)
            for sub in attr.graphs:
                yield from initializers(sub)


def external_files(proto: onnx.ModelProto) -> set[str]:
    """The external-data files that ``proto`` (loaded without its external data) names."""
    files = set()
    for t in initializers(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            files.update(e.value for e in t.external_data if e.key == "location")
    return files


def load_graph(path: Path) -> onnx.ModelProto:
    """A graph file of the export being written, with the external data it names (files beside it, never
    elsewhere: the exporter wrote them)."""
    return _load(path)[0]


def _load(path: Path) -> tuple[onnx.ModelProto, set[str]]:
    """(the graph with its external data, the names of the files that data came from)."""
    proto = onnx.load(str(path), load_external_data=False)
    files = external_files(proto)
    for name in files:
        if Path(name).name != name or not (path.parent / name).is_file():
            raise ExportError(f"{path.name} names external data {name!r}, which is not a file beside it")
    onnx.load_external_data_for_model(proto, str(path.parent))
    return proto, files


def save_graph(proto: onnx.ModelProto, path: Path) -> None:
    """Save a graph with its weights in ``<name>.data`` beside it (any such file is replaced), so that no graph
    is ever limited by protobuf's 2 GB."""
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=MIN_BYTES)


def store_once(folder: Path, graph_files: dict[str, str]) -> dict[str, int | str]:
    """Move the weights of the graphs ``graph_files`` (graph -> file name in ``folder``) into one
    ``WEIGHTS_FILE``, each distinct tensor once; rewrite the graphs to point at it and remove the per-graph data
    files they named. Returns the manifest's ``weights`` entry ({"file", "bytes"})."""
    path = folder / WEIGHTS_FILE
    stored: dict[bytes, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)
    with open(path, "xb") as out:
        for fname in graph_files.values():
            gpath = folder / fname
            proto, leftover = _load(gpath)
            for t in initializers(proto.graph):
                if not t.HasField("raw_data") or len(t.raw_data) < MIN_BYTES:
                    continue
                key = hashlib.sha256(t.raw_data).digest()
                if key not in stored:
                    align = PAGE if len(t.raw_data) >= PAGE else SMALL_ALIGN
                    pos = out.tell()
                    out.write(b"\0" * (-pos % align))
                    stored[key] = (out.tell(), len(t.raw_data))
                    out.write(t.raw_data)
                offset, length = stored[key]
                set_external_data(t, WEIGHTS_FILE, offset=offset, length=length)
                t.data_location = onnx.TensorProto.EXTERNAL
                t.ClearField("raw_data")
            onnx.save(proto, str(gpath))  # the graph alone now: its large tensors are references
            del proto
            for name in leftover - {WEIGHTS_FILE}:
                (folder / name).unlink()
        size = out.tell()
    return {"file": WEIGHTS_FILE, "bytes": size}


def tensor_bytes(proto: onnx.ModelProto) -> int:
    """Bytes of every initializer of a graph loaded without its external data: inline bytes plus the length
    each external reference names."""
    total = 0
    for t in initializers(proto.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            total += int(next((e.value for e in t.external_data if e.key == "length"), 0))
        else:
            total += len(t.raw_data) if t.HasField("raw_data") else onnx.numpy_helper.to_array(t).nbytes
    return total


__all__ = ["MIN_BYTES", "PAGE", "WEIGHTS_FILE", "external_files", "initializers", "load_graph", "save_graph", "store_once", "tensor_bytes"]
