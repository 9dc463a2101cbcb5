"""Traced graphs kept on disk, so that exporting the same model again skips torch.onnx.

A torch.onnx trace is most of an export's time (the tests' tiny models: 2-3 s a graph; Qwen3.5-0.8B's 24 layers at
a reduced width: ~75 s a graph), and it depends only on the model and on the few options that change the graph torch sees: the graph's
role and inputs (``ragged``), the opset, the lowering (``ops``) and the longest prefill the delta rule's scan is
built for (``max_sequence``). Precision, state dtype, the int8 scheme, the embedding's storage, budgets, the
smoke check and the tokenizer all work on the traced fp32 graphs afterwards. So an export of a model to fp32,
then int8, then int4 traces it once when the three are given one ``trace_cache`` folder.

A trace is found by a key that holds everything the trace could depend on:

- the model: the class of every submodule with its path, each module's plain attributes (sizes, flags, configs),
  and the bytes of every parameter and buffer (after ``--chunk-size`` and the cast to float32);
- the code: the source of edgelin's own package and of every file that defines a class or function of the model
  (a user's model class), and the versions of Python, torch, onnx and onnxscript;
- the graph: its role, input and output names, example shapes and dtypes, dynamic dimensions; opset, lowering,
  ``max_sequence``.

What it cannot see is code changed while a process runs (a monkeypatched method), or the code of a class whose
source file cannot be read (typed into an interpreter: known by its name only), so the cache is never used unless
asked for. An entry is ``<key>/`` with the graph's files and ``trace.json`` (what it holds and their sha256),
written in a hidden folder and renamed into place; an entry whose files do not match their record is not used,
and the next trace of that graph replaces it. Nothing else in the folder is read, changed or removed. Entries are
as large as the traced graph with its weights (about the fp32 model's size per graph): delete the folder when it
is no longer wanted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import json
import marshal
import os
import platform
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from edgelin.exporters import deferred
from edgelin.runtime.manifest import file_sha256

ENTRY_FILE = "trace.json"
FORMAT = 1
_CHUNK = 1 << 20


def _describe(value: Any, depth: int = 0) -> Any:
    """A JSON value for a module attribute: plain values as they are; containers, dataclasses and other objects
    item by item; tensors by dtype, shape and the sha256 of their bytes; functions by where they are defined, the
    hash of their bytecode and what their closure holds; dtypes and enums by name."""
    if depth > 8:
        return f"<{type(value).__qualname__}>"
    down = depth + 1
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # exact, and nan / inf stay JSON
    if isinstance(value, (torch.dtype, torch.device, enum.Enum)):
        return str(value)
    if isinstance(value, torch.Tensor):
        h = hashlib.sha256()
        _tensor_digest(h, value)
        return {"tensor": h.hexdigest()}
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return {"array": hashlib.sha256(f"{data.dtype}{data.shape}".encode() + (data.tobytes() if data.dtype != object else b"")).hexdigest()}
    if isinstance(value, np.generic):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [_describe(v, down) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v, down) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(_describe(v, down), sort_keys=True) for v in value)
    if isinstance(value, functools.partial):
        return {"partial": _describe(value.func, down), "args": _describe(value.args, down), "kw": _describe(value.keywords, down)}
    if inspect.ismethod(value):
        return {"method": _describe(value.__func__, down), "of": f"{type(value.__self__).__module__}.{type(value.__self__).__qualname__}"}
    if inspect.isfunction(value):
        code = hashlib.sha256(marshal.dumps(value.__code__)).hexdigest()
        cells = [c.cell_contents for c in value.__closure__ or () if c.cell_contents is not value]
        return {"function": f"{value.__module__}.{value.__qualname__}", "code": code,
                "closure": _describe(cells, down), "defaults": _describe(value.__defaults__, down)}
    if inspect.isclass(value) or callable(value) and not hasattr(value, "__dict__"):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, torch.nn.Module):
        return {"module": kind}  # described where named_modules lists it
    if dataclasses.is_dataclass(value):
        return {"object": kind, "attrs": {f.name: _describe(getattr(value, f.name), down) for f in dataclasses.fields(value)}}
    if hasattr(value, "__dict__"):
        return {"object": kind, "attrs": _describe(vars(value), down)}
    return f"<{kind}>"


_SKIPPED = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _module_record(module: torch.nn.Module) -> dict:
    """A module's class and plain attributes (torch's hook tables and the like are skipped: they are empty or
    the same for every model; a registered hook is described by its function)."""
    attrs = {k: _describe(v) for k, v in sorted(vars(module).items()) if k not in _SKIPPED}
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}", "attrs": attrs}


def _tensor_digest(h, tensor: torch.Tensor) -> None:
    t = tensor.detach().contiguous().cpu()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else t.numpy().tobytes())


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        h.update(name.encode())
        _tensor_digest(h, tensor)
    return h.hexdigest()


def _package_dirs() -> list[Path]:
    import edgelin
    import edgelin.exporters
    import edgelin.runtime

    return sorted({Path(m.__file__).resolve().parent for m in (edgelin, edgelin.exporters, edgelin.runtime)})


def _source_files(model: torch.nn.Module) -> list[Path]:
    """edgelin's own sources, and every file outside it that defines one of the model's classes or functions."""
    files = {p.resolve() for d in _package_dirs() for p in d.rglob("*.py")}
    for module in model.modules():
        for obj in (type(module), *[v for v in vars(module).values() if inspect.isfunction(v) or inspect.isclass(v)]):
            with contextlib.suppress(TypeError, OSError):
                source = inspect.getsourcefile(obj)
                if source and os.path.exists(source):
                    files.add(Path(source).resolve())
    return sorted(files)


def _code_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for path in _source_files(model):
        h.update(str(path.name).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _versions() -> dict[str, str]:
    import onnx

    try:
        import onnxscript

        script = onnxscript.__version__
    except ImportError:  # pragma: no cover - torch.onnx needs it
        script = "none"
    return {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__, "onnxscript": script,
            "format": str(FORMAT)}


def _example_record(example: tuple) -> list:
    return [[str(t.dtype), list(t.shape)] if isinstance(t, torch.Tensor) else _describe(t) for t in example]


def model_key(model: torch.nn.Module) -> dict:
    """The part of a trace's key that belongs to the model (computed once per export)."""
    modules = {name or "<root>": _module_record(m) for name, m in model.named_modules(remove_duplicate=False)}
    return {"modules": hashlib.sha256(json.dumps(modules, sort_keys=True).encode()).hexdigest(),
            "weights": _weights_digest(model), "code": _code_digest(model), "versions": _versions()}


def trace_key(model_part: dict, *, graph: str, names: tuple[list[str], list[str]], example: tuple, dynamic: Any,
              opset: int, ops: str, max_sequence: int) -> str:
    """The hex key of one graph's trace."""
    record = {"model": model_part, "graph": graph, "inputs": list(names[0]), "outputs": list(names[1]),
              "example": _example_record(example), "dynamic": _describe(dynamic), "opset": opset, "ops": ops,
              "max_sequence": max_sequence}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:32]


def _copy_hashing(src: Path, dst: Path) -> str:
    """Copy ``src`` to ``dst`` and return the sha256 of what was read: one pass over a file of gigabytes. A traced
    graph's data file is copied as written in full: the weights the trace left unwritten come from the parameters
    (``edgelin.exporters.deferred``)."""
    h = hashlib.sha256()
    with open(dst, "wb") as fout:
        for chunk in deferred.file_pieces(src, _CHUNK):
            h.update(chunk)
            fout.write(chunk)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Hit:
    """A usable entry: its files were copied into the export's folder."""

    key: str
    files: tuple[str, ...]
    bound_used: bool


class TraceCache:
    """``lookup(key, dest)`` copies a stored trace's files into ``dest``; ``store(key, dest, files, bound_used)``
    keeps the files a trace wrote. ``lock(key)`` serialises two processes tracing the same graph (where the
    platform has ``fcntl``; elsewhere both trace and one keeps its entry)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"trace cache {self.root} is a file; give a folder")

    def entry(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            yield
            return
        with open(self.root / f".{key}.lock", "a+") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _record(self, key: str, *, hashes: bool = True) -> dict | None:
        """The entry's record where every file it names is there (with its recorded hash, where ``hashes``); else None."""
        entry = self.entry(key)
        try:
            record = json.loads((entry / ENTRY_FILE).read_text(encoding="utf-8"))
            files = record["files"]
            if record.get("format") != FORMAT or not files or not all(
                    (entry / name).is_file() and (not hashes or file_sha256(entry / name) == digest) for name, digest in files.items()):
                return None
            return record
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def _retire(self, key: str) -> None:
        """Remove a broken entry: only one that holds a trace record (edgelin's), never another folder."""
        entry = self.entry(key)
        if not (entry / ENTRY_FILE).is_file():
            raise FileExistsError(f"{entry} is in the way and is not a trace cache entry; remove it or use another folder")
        stale = self.root / f".{key}.{os.getpid()}.stale"
        os.rename(entry, stale)
        shutil.rmtree(stale, ignore_errors=True)

    def lookup(self, key: str, dest: Path) -> Hit | None:
        """Copy the entry's files into ``dest`` (a copy: the export rewrites its graphs in place), each checked against
        its recorded sha256 as it is read; where one differs, what was copied is removed again and None returned."""
        record = self._record(key, hashes=False)
        if record is None:
            return None
        copied = []
        try:
            for name, digest in record["files"].items():
                copied.append(dest / name)
                if _copy_hashing(self.entry(key) / name, dest / name) != digest:
                    raise ValueError(f"{name} changed since it was stored")
        except (OSError, ValueError):
            for path in copied:
                path.unlink(missing_ok=True)
            return None
        return Hit(key=key, files=tuple(record["files"]), bound_used=bool(record.get("bound_used")))

    def store(self, key: str, src: Path, files: list[str], bound_used: bool) -> bool:
        """Keep ``files`` (names in ``src``) as ``key``'s entry; False where an entry is already there. An OSError
        (a full disk, a folder that cannot be written) is raised with nothing of the entry left behind."""
        entry = self.entry(key)
        if entry.exists():
            if self._record(key) is not None:
                return False
            self._retire(key)  # an entry whose files no longer match their record (one was changed or lost)
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".{key}.{os.getpid()}.tmp"
        shutil.rmtree(staging, ignore_errors=True)  # this process's own leftover, by its name
        try:
            staging.mkdir()
            digests = {}
            for name in files:
                digests[name] = _copy_hashing(src / name, staging / name)
            (staging / ENTRY_FILE).write_text(json.dumps({"format": FORMAT, "files": digests, "bound_used": bound_used}, indent=1),
                                              encoding="utf-8")
            try:
                os.rename(staging, entry)
            except OSError:
                if entry.exists():  # another process kept the same trace first
                    return False
                raise
            return True
        finally:
            shutil.rmtree(staging, ignore_errors=True)
