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

The bytes are streamed from the per-graph files to the weights file a piece at a time: memory holds one piece, not
a graph's weights.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgelin.errors import ExportError
from edgelin.exporters import deferred

WEIGHTS_FILE = "weights.data"
MIN_BYTES = 1024  # smaller initializers stay inside the graph
PAGE = 64 << 10
SMALL_ALIGN = 64
STREAM = 16 << 20  # bytes read and written at a time


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


def open_graph(path: Path) -> onnx.ModelProto:
    """A graph file of the export being written, its large tensors left where they are: external references into
    the files beside it (never elsewhere: the exporter wrote them), read one at a time with ``tensor_values`` and
    written on with ``save_graph``. A graph in memory holds its nodes and small tensors, not the model's weights."""
    return _structure(path)[0]


def _structure(path: Path) -> tuple[onnx.ModelProto, set[str]]:
    """(the graph without its external data, the names of the data files it reads: each one beside it)."""
    proto = onnx.load(str(path), load_external_data=False)
    files = external_files(proto)
    for name in files:
        if Path(name).name != name or not (path.parent / name).is_file():
            raise ExportError(f"{path.name} names external data {name!r}, which is not a file beside it")
    return proto, files


def tensor_values(t: onnx.TensorProto, folder: Path) -> np.ndarray:
    """An initializer's values: inline, or mapped read-only from its external file in ``folder`` (file pages, read as
    they are used: a quantiser that works through a table in row blocks holds one block, not the table)."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(t)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    source, offset, length = external_range(t, folder)
    shape = tuple(t.dims)
    if length != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
        raise ExportError(f"{t.name}: {length:,} bytes in {source.name} for a {dtype.name} tensor of shape {list(shape)}")
    if length == 0:
        return np.zeros(shape, dtype)
    held = deferred.values(source, offset, length, dtype, shape)  # a weight the trace left unwritten: the parameter's view
    if held is not None:
        return held
    return np.memmap(source, dtype=dtype, mode="r", offset=offset, shape=shape)


def spilled(raw: bytes) -> bool:
    """Whether an inline tensor of these bytes goes to the data file: onnx.save's rule at ``MIN_BYTES``, which compares
    the Python object's size (``sys.getsizeof``: the bytes and its header), kept so that the files are the same bytes
    as a graph saved by onnx with that threshold."""
    return sys.getsizeof(raw) >= MIN_BYTES


class Spill:
    """Tensors a converter makes, appended to ``graph``'s initializers as it goes: each one ``spilled`` says is large
    written to the file ``path`` (aligned to 64 bytes, referenced from there by its full path: ``save_graph`` copies it
    on, or adopts the file as one of the graph's data files), the others inline, as onnx.save would keep them. Memory
    holds the tensor being added."""

    def __init__(self, graph: onnx.GraphProto, path: Path) -> None:
        self.graph, self.path = graph, path

    def __enter__(self) -> "Spill":
        self.out = open(self.path, "ab")
        return self

    def __exit__(self, *exc) -> None:
        self.out.close()

    def add(self, name: str, array: np.ndarray, data_type: int) -> None:
        t = self.graph.initializer.add()  # appended, not built and copied: a list handed to extend() is copied whole
        t.name, t.data_type = name, data_type
        t.dims.extend(array.shape)
        raw = np.ascontiguousarray(array).tobytes()
        if not spilled(raw):
            t.raw_data = raw
            return
        out = self.out
        out.write(b"\0" * (-out.tell() % 64))
        begin = out.tell()
        out.write(raw)
        for key, value in (("location", str(self.path)), ("offset", begin), ("length", out.tell() - begin)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        t.data_location = onnx.TensorProto.EXTERNAL


class Reuse:
    """The tensors a converter made from one of the model's parameters (``deferred.identity``) in a graph already saved,
    handed to the converter of the export's next graph that reads the same parameter: it refers to them in that graph's
    data file instead of making and writing them again (the decode graph holds every weight the prefill graph holds: at
    9 B parameters in int8, 9.5 GB written twice), and ``save_graph`` leaves those references as they are."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[tuple, int]] = {}  # a tensor made in the graph being converted -> (its source's identity, its place)
        self._made: dict[tuple, list[onnx.TensorProto | None]] = {}  # identity -> the tensors made from it, as saved
        self.files: set[str] = set()  # the data files of the graphs saved: a later graph may refer into them

    def find(self, key: tuple | None) -> list[onnx.TensorProto] | None:
        """The tensors made from the source ``key`` in a graph saved before (unnamed copies), or None."""
        made = self._made.get(key) if key is not None else None
        return None if made is None or any(t is None for t in made) else [_copy_unnamed(t) for t in made]

    def made(self, key: tuple | None, names: list[str]) -> None:
        """The tensors ``names`` of the graph being converted were made from the source ``key`` (None: not a parameter)."""
        if key is not None and key not in self._made:
            self._made[key] = [None] * len(names)
            self._pending.update({n: (key, i) for i, n in enumerate(names)})

    def saved(self, proto: onnx.ModelProto, path: Path) -> None:
        """``proto`` was saved as ``path`` (``save_graph``): its tensors made here are found from now on, where they stand."""
        for t in initializers(proto.graph):
            if t.name in self._pending:
                key, i = self._pending.pop(t.name)
                self._made[key][i] = _copy_unnamed(t)
        for key in [k for k, made in self._made.items() if any(t is None for t in made)]:  # a tensor that did not survive
            del self._made[key]
        self._pending.clear()
        self.files.update(external_files(proto))


def _copy_unnamed(t: onnx.TensorProto) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(t)
    out.ClearField("name")
    return out


def save_graph(proto: onnx.ModelProto, path: Path, recast: dict[str, Callable[[bytes], bytes]] | None = None,
               keep: set[str] = frozenset(), adopt: Path | None = None) -> None:
    """Save a graph with its weights in ``<name>.data`` beside it, so that no graph is ever limited by protobuf's 2 GB:
    each inline tensor ``spilled`` says is large written out, each tensor still external (a reference into a file in
    ``path.parent``, ``<name>.data`` itself included) copied a piece of ``STREAM`` bytes at a time, through
    ``recast[name]`` where one is given (a converter that changed the tensor's type without reading its bytes: fp16's,
    elementwise, so piece by piece). The data file is written beside and moved over ``<name>.data`` at the end; memory
    holds one piece. A tensor in a file of ``keep`` (another graph's data file beside it: ``Reuse``) is left there.
    ``adopt``: a converter's spill file beside the graph (``Spill``), which becomes one of the graph's data files: its
    tensors are referred to where they are, by the file's name, not copied (the disk then holds a converted graph's
    weights once, not twice while it is saved)."""
    recast = recast or {}
    data = path.with_name(path.name + ".data")
    fresh = data.with_name(data.name + ".new")
    adopted, read_adopted = ({str(adopt), adopt.name} if adopt is not None else set()), False
    with open(fresh, "wb") as out:
        def refer(t: onnx.TensorProto, begin: int) -> None:
            del t.external_data[:]
            for key, value in (("location", data.name), ("offset", begin), ("length", out.tell() - begin)):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            t.data_location = onnx.TensorProto.EXTERNAL

        for t in initializers(proto.graph):
            where = {e.key: e.value for e in t.external_data}.get("location") if t.data_location == onnx.TensorProto.EXTERNAL else None
            if where in keep:
                continue
            if where is not None and where in adopted:
                for e in t.external_data:
                    if e.key == "location":
                        e.value = adopt.name
                read_adopted = True
                continue
            if t.data_location == onnx.TensorProto.EXTERNAL:
                convert = recast.get(t.name, lambda piece: piece)
                pieces = (convert(piece) for piece in _read_range(*external_range(t, path.parent)))
                out.write(b"\0" * (-out.tell() % SMALL_ALIGN))
                begin = out.tell()
                for piece in pieces:
                    out.write(piece)
                refer(t, begin)
            elif t.HasField("raw_data") and spilled(t.raw_data):
                out.write(b"\0" * (-out.tell() % SMALL_ALIGN))
                begin = out.tell()
                out.write(t.raw_data)
                t.ClearField("raw_data")
                refer(t, begin)
    onnx.save(proto, str(path))
    if fresh.stat().st_size or adopt is None:
        fresh.replace(data)
    else:  # every large tensor is in the adopted file or another graph's: no data file of its own
        fresh.unlink()
        data.unlink(missing_ok=True)
    if adopt is not None and not read_adopted:  # nothing large was spilled: the empty file goes
        adopt.unlink(missing_ok=True)


def store_once(folder: Path, graph_files: dict[str, str]) -> dict[str, int | str]:
    """Move the weights of the graphs ``graph_files`` (graph -> file name in ``folder``) into one
    ``WEIGHTS_FILE``, each distinct tensor once; rewrite the graphs to point at it and remove the per-graph data
    files they named. Returns the manifest's ``weights`` entry ({"file", "bytes"}).

    Streaming: a tensor's bytes go from its graph's data file to the weights file in pieces of ``STREAM`` bytes,
    hashed on the way (a tensor already written is cut off again), so memory stays at one piece whatever the
    model's size."""
    path = folder / WEIGHTS_FILE
    stored: dict[bytes, tuple[int, int]] = {}  # sha256 of the bytes -> (offset, length)
    with open(path, "xb") as out:

        def place(pieces: Iterator[bytes], length: int) -> tuple[int, int]:
            start = out.tell()
            out.write(b"\0" * (-start % (PAGE if length >= PAGE else SMALL_ALIGN)))
            begin, digest = out.tell(), hashlib.sha256()
            for piece in pieces:
                digest.update(piece)
                out.write(piece)
            key = digest.digest()
            if key in stored:  # written before: cut this copy off again
                out.seek(start)
                out.truncate()
            else:
                stored[key] = (begin, length)
            return stored[key]

        last = {name: fname for fname in graph_files.values() for name in _structure(folder / fname)[1]}  # a file goes after its last reader
        for fname in graph_files.values():
            gpath = folder / fname
            proto, leftover = _structure(gpath)
            for t in initializers(proto.graph):
                if t.data_location == onnx.TensorProto.EXTERNAL:
                    source, offset, length = external_range(t, folder)
                    if length < MIN_BYTES:  # small: back inside the graph, as save_graph keeps them
                        data = b"".join(_read_range(source, offset, length))
                        del t.external_data[:]
                        t.data_location = onnx.TensorProto.DEFAULT
                        t.raw_data = data
                        continue
                    where = place(_read_range(source, offset, length), length)
                elif t.HasField("raw_data") and len(t.raw_data) >= MIN_BYTES:
                    where = place(iter([t.raw_data]), len(t.raw_data))
                    t.ClearField("raw_data")
                else:
                    continue
                del t.external_data[:]
                for key, value in (("location", WEIGHTS_FILE), ("offset", where[0]), ("length", where[1])):
                    entry = t.external_data.add()
                    entry.key, entry.value = key, str(value)
                t.data_location = onnx.TensorProto.EXTERNAL
            onnx.save(proto, str(gpath))  # the graph alone now: its large tensors are references
            del proto
            for name in leftover - {WEIGHTS_FILE}:
                if last[name] == fname:
                    (folder / name).unlink()
        size = out.tell()
    return {"file": WEIGHTS_FILE, "bytes": size}


def external_range(t: onnx.TensorProto, folder: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes, its file in ``folder``."""
    info = {e.key: e.value for e in t.external_data}
    source = folder / info["location"]
    offset = int(info.get("offset", 0))
    return source, offset, int(info["length"]) if "length" in info else source.stat().st_size - offset


def read_external(t: onnx.TensorProto, folder: Path) -> bytes:
    """An external tensor's bytes (one tensor read whole), its file in ``folder``."""
    return b"".join(_read_range(*external_range(t, folder)))


def _read_range(path: Path, offset: int, length: int) -> Iterator[bytes]:
    """``length`` bytes of ``path`` from ``offset``, in pieces of at most ``STREAM`` bytes (a weight the trace left
    unwritten, ``edgelin.exporters.deferred``: from the parameter it is a view of)."""
    held = deferred.pieces(path, offset, length)
    if held is not None:
        yield from held
        return
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            piece = f.read(min(left, STREAM))
            if not piece:
                raise ExportError(f"{path.name} ends before the tensor it should hold ({length:,} bytes from {offset:,})")
            left -= len(piece)
            yield piece


def tied_head_in_place(proto: onnx.ModelProto) -> int:
    """Rewrite each MatMul that reads a constant [V, D] table through Transpose [1, 0] (a tied head: its weight is
    the token embedding, which the Gather reads row by row) as Gemm with ``transB`` on the table itself, the
    input flattened to [N, D] and the product shaped back. ONNX Runtime folds such a Transpose into a new
    [D, V] tensor in each session that loads the graph (1 GB for a 250k x 1,024 vocabulary, twice for the two
    graphs); Gemm reads the table where it is, mapped from the weights file. The same product, in place.
    fp32 tables only (an fp16 Gemm is not in every ONNX Runtime's CPU kernels). Returns the number of heads
    rewritten."""
    graph = proto.graph
    tables = {t.name: t for t in graph.initializer if len(t.dims) == 2 and t.data_type == onnx.TensorProto.FLOAT}
    transposed = {}
    for n in graph.node:
        perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
        if n.op_type == "Transpose" and n.input[0] in tables and perm in (None, [1, 0]):
            transposed[n.output[0]] = n
    done = 0
    for m in [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in transposed]:
        t = transposed[m.input[1]]
        V, D = tables[t.input[0]].dims
        x, y, base = m.input[0], m.output[0], m.name or f"tied_head_{done}"
        flat_shape = numpy_helper.from_array(np.array([-1, D], dtype=np.int64), f"{base}_flat_shape")
        vocab = numpy_helper.from_array(np.array([V], dtype=np.int64), f"{base}_vocab")
        graph.initializer.extend([flat_shape, vocab])
        new = [
            helper.make_node("Reshape", [x, flat_shape.name], [f"{base}_flat"], name=f"{base}_flat"),
            helper.make_node("Gemm", [f"{base}_flat", t.input[0]], [f"{base}_gemm"], name=f"{base}_gemm", transB=1),
            helper.make_node("Shape", [x], [f"{base}_lead"], name=f"{base}_lead", end=-1),
            helper.make_node("Concat", [f"{base}_lead", vocab.name], [f"{base}_shape"], name=f"{base}_shape", axis=0),
            helper.make_node("Reshape", [f"{base}_gemm", f"{base}_shape"], [y], name=f"{base}_out"),
        ]
        at = list(graph.node).index(m)
        graph.node.remove(m)
        for k, node in enumerate(new):
            graph.node.insert(at + k, node)
        done += 1
    for t in transposed.values():
        if not any(t.output[0] in n.input for n in graph.node) and t.output[0] not in {o.name for o in graph.output}:
            graph.node.remove(t)
    return done


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


__all__ = ["MIN_BYTES", "PAGE", "WEIGHTS_FILE", "Reuse", "Spill", "external_files", "initializers", "open_graph", "save_graph", "spilled", "store_once", "tensor_bytes", "tensor_values", "tied_head_in_place"]
