"""Weights the trace does not write: a traced graph's data file with holes where its weights would be.

torch.onnx hands back its graph with each initializer still tied to the model: the parameters themselves, or, where
its optimiser folded an op on a weight (the Transpose of every linear's weight), a NumPy view of the parameter's
memory. Saving it writes all of them in float32 into ``<graph>.data``, a second copy of the model on disk (a streamed
export already holds one, its scratch file), only for the precision converter to read them back once and write the
converted tensors.

Inside ``deferring(model)`` (the exporter's trace, conversion and store), ``save`` writes a traced graph as torch.onnx
would, with the same layout, except that each external initializer whose values are a view of one of ``model``'s
parameters is not written: its bytes stay a hole in a sparse data file of the right length, and the view is held
here, keyed by the file and the tensor's range. Every reader of a traced graph's weights in edgelin
(``edgelin.exporters.weights``: ``tensor_values``, the ranges the converters and ``store_once`` read, and the trace
cache's copy) asks ``values`` / ``pieces`` first, so they see the parameter's values: the same bytes as a data file
written in full, without the disk. A read that overlaps a held range other than exactly is refused, never answered
with the hole's zeros; a data file that has changed since (a converter writes a new one over it) is no longer held.
The parameters must not change while they are held: nothing edgelin runs between the trace and the store does.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from numpy.lib.array_utils import byte_bounds

from edgelin.errors import ExportError

PIECE = 8 << 20  # bytes per piece of a held tensor handed to a reader
ENABLED = True  # False: every traced graph written in full, as torch.onnx writes it (the tests compare the two)


@dataclass(frozen=True)
class _Held:
    offset: int
    length: int
    values: np.ndarray  # a view of a parameter's memory, in the initializer's shape and dtype


class Deferral:
    """The parameters of one model whose views a traced graph need not write, and the ranges held so far."""

    def __init__(self, model) -> None:
        spans = []
        for p in model.parameters():
            storage = p.untyped_storage()
            if storage.nbytes():
                spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        self._spans = sorted(spans)
        self._files: dict[str, tuple[tuple[int, int, int, int], list[_Held]]] = {}

    def owns(self, values: np.ndarray) -> bool:
        """Whether ``values`` lies wholly within one parameter's memory."""
        if values.size == 0:
            return False
        low, high = byte_bounds(values)
        return any(a <= low and high <= b for a, b in self._spans)

    def hold(self, data: Path, held: list[_Held]) -> None:
        st = data.stat()
        self._files[os.path.realpath(data)] = ((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), sorted(held, key=lambda h: h.offset))

    def held(self, path: Path) -> list[_Held]:
        """The ranges held in ``path``, where it is still the file they were held for; else none (and forgotten)."""
        key = os.path.realpath(path)
        entry = self._files.get(key)
        if entry is None:
            return []
        try:
            st = Path(key).stat()
        except OSError:
            st = None
        if st is None or (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != entry[0]:
            del self._files[key]
            return []
        return entry[1]

    @property
    def count(self) -> int:
        return sum(len(h) for _, h in self._files.values())


_ACTIVE: list[Deferral] = []


@contextlib.contextmanager
def deferring(model) -> Iterator[Deferral | None]:
    """Traced graphs of ``model`` saved inside this context leave its parameters' bytes unwritten (module docstring);
    the views are let go when it ends. Yields None where deferral is off (``ENABLED``)."""
    if not ENABLED:
        yield None
        return
    d = Deferral(model)
    _ACTIVE.append(d)
    try:
        yield d
    finally:
        _ACTIVE.remove(d)
        d._files.clear()


def active() -> Deferral | None:
    return _ACTIVE[-1] if _ACTIVE else None


def _unwritten(cls: type) -> type:
    """A subclass of an onnx_ir tensor class whose ``tofile`` writes nothing (the writer seeks to each tensor's offset)."""
    sub = _UNWRITTEN.get(cls)
    if sub is None:
        sub = _UNWRITTEN[cls] = type(f"Unwritten{cls.__name__}", (cls,), {"__slots__": (), "tofile": lambda self, file: None})
    return sub


_UNWRITTEN: dict[type, type] = {}


def save(model, path: Path) -> int:
    """Save torch.onnx's graph ``model`` (an onnx_ir Model) to ``path`` with its weights in ``<name>.data``, as torch.onnx's
    own save does, leaving holes for the views of the active deferral's parameters. Returns the number of tensors held."""
    import onnx_ir as ir

    d = active()
    data = path.with_name(path.name + ".data")
    swapped: dict[int, tuple[object, type, np.ndarray]] = {}
    for value in model.graph.initializers.values():
        t = value.const_value
        if d is None or t is None or not hasattr(t, "numpy") or not hasattr(t, "tofile"):
            continue
        try:
            view = t.numpy()
        except Exception:  # a tensor NumPy cannot view: written as usual
            continue
        if isinstance(view, np.ndarray) and d.owns(view):
            swapped[id(t)] = (t, type(t), view)
    written: list[_Held] = []

    def note(tensor, info) -> None:
        got = swapped.get(id(tensor))
        if got is not None:
            written.append(_Held(int(info.offset), int(got[2].nbytes), got[2]))

    for t, cls, _ in swapped.values():
        t.__class__ = _unwritten(cls)
    try:
        ir.save(model, str(path), external_data=data.name, callback=note)
    finally:
        for t, cls, _ in swapped.values():
            t.__class__ = cls
    if written:
        end = max(h.offset + h.length for h in written)
        if data.stat().st_size < end:  # the last tensor was a hole: the file reaches past it all the same
            os.truncate(data, end)
        d.hold(data, written)
    return len(written)


def values(path: Path, offset: int, length: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray | None:
    """The held tensor at exactly (``offset``, ``length``) of ``path`` in ``dtype`` and ``shape``; None where ``path``
    holds no tensor there (read the file)."""
    h = _find(path, offset, length)
    if h is None:
        return None
    if h.values.dtype != dtype or tuple(h.values.shape) != tuple(shape):
        raise ExportError(f"{path.name}: the tensor at {offset:,} is held as {h.values.dtype} {list(h.values.shape)}, "
                          f"read as {np.dtype(dtype)} {list(shape)}")
    return h.values


def pieces(path: Path, offset: int, length: int) -> Iterator[bytes] | None:
    """The held tensor at exactly (``offset``, ``length``) of ``path`` as C-order bytes, in pieces of about ``PIECE``
    bytes; None where ``path`` holds no tensor there."""
    h = _find(path, offset, length)
    return None if h is None else _bytes_of(h.values)


def file_pieces(path: Path, piece: int = PIECE) -> Iterator[bytes]:
    """The whole of ``path`` as a data file written in full would hold it: its bytes, the held tensors' in their holes."""
    d = active()
    held = d.held(path) if d is not None else []
    with open(path, "rb") as f:
        pos = 0
        for h in [*held, _Held(os.fstat(f.fileno()).st_size, 0, np.zeros(0, np.uint8))]:
            f.seek(pos)
            while pos < h.offset:
                chunk = f.read(min(piece, h.offset - pos))
                if not chunk:
                    raise ExportError(f"{path.name} ends before the tensor it should hold at {h.offset:,}")
                pos += len(chunk)
                yield chunk
            if h.length:
                yield from _bytes_of(h.values)
                pos = h.offset + h.length


def identity(values: np.ndarray) -> tuple | None:
    """Which parameter's memory ``values`` is (its address, shape, strides and type), where it lies within one of the
    model's parameters while a deferral is active: the same weight read by another graph of the export; else None."""
    d = active()
    if d is None or not isinstance(values, np.ndarray) or not d.owns(values):
        return None
    return values.__array_interface__["data"][0], values.shape, values.strides, values.dtype.str


def _find(path: Path, offset: int, length: int) -> _Held | None:
    d = active()
    if d is None:
        return None
    for h in d.held(path):
        if h.offset == offset and h.length == length:
            return h
        if h.offset < offset + length and offset < h.offset + h.length:
            raise ExportError(f"{path.name}: bytes {offset:,}-{offset + length:,} read across the tensor held at {h.offset:,}")
    return None


def _bytes_of(a: np.ndarray) -> Iterator[bytes]:
    """``a``'s bytes in C order, in pieces of about ``PIECE`` bytes (rows along its first axis, a row split where it is larger)."""
    if a.ndim == 0 or a.nbytes <= PIECE:
        yield np.ascontiguousarray(a).tobytes()
        return
    row = a[0].nbytes
    if a.ndim > 1 and row > PIECE:
        for i in range(a.shape[0]):
            yield from _bytes_of(a[i])
        return
    rows = max(1, PIECE // max(1, row))
    for i in range(0, a.shape[0], rows):
        yield np.ascontiguousarray(a[i:i + rows]).tobytes()


__all__ = ["Deferral", "ENABLED", "active", "deferring", "file_pieces", "identity", "pieces", "save", "values"]
