"""The export manifest (``edgelin.json``): everything a runtime needs to drive the two graphs.

The schema lives here, in the runtime, because the runtime is what must read it on a device.
Standard library + numpy only.

    {
      "format": "edgelin/1",
      "graphs": {"prefill": "prefill.onnx", "decode": "decode.onnx"},
      "input_ids": "input_ids", "logits": "logits",
      "states": [{"input": "state.0.S", "output": "present.0.S", "shape": ["batch", 4, 64, 64],
                  "dtype": "float32", "init": 0.0}, ...],
      "vocab_size": 256, "tokenizer": {"kind": "bytes"}, "model": {...config...},
      "opset": 18, "precision": "fp32", "edgelin_version": "0.1.0", "source": "<sha256 of the weights>",
      ... extra fields (chunk_size, node counts) are allowed ...
    }
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.errors import ManifestError

FORMAT = "edgelin/1"
MANIFEST_FILE = "edgelin.json"
METADATA_KEY = "edgelin"  # key of the manifest in each graph's metadata_props
BATCH = "batch"
STATE_PREFIX, PRESENT_PREFIX = "state.", "present."  # graph input / output name of the state with key K
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
GRAPHS = ("prefill", "decode")
MAX_DIM = 1 << 31  # a fixed dim or vocabulary size beyond this is a corrupt manifest
MAX_MANIFEST_BYTES = 16 << 20
REQUIRED = (
    "format", "graphs", "input_ids", "logits", "states", "vocab_size", "tokenizer",
    "model", "opset", "precision", "edgelin_version", "source",
)


def state_io_names(key: str) -> tuple[str, str]:
    """The one place a state key ("{layer}.{name}", e.g. "0.S") becomes its graph input and output names."""
    return f"{STATE_PREFIX}{key}", f"{PRESENT_PREFIX}{key}"


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state tensor: the state contract shared by the model (``state_specs()``), the
    exporter, the manifest and every runtime. Consumers pair tensors by ``key``, never by position."""

    input: str  # graph input name, e.g. "state.0.S"
    output: str  # graph output name, e.g. "present.0.S"
    shape: tuple  # ints and symbolic dims (strings): e.g. ("batch", 4, 64, 64)
    dtype: str  # a key of DTYPES
    init: float | int  # value of a fresh sequence's state

    @classmethod
    def for_key(cls, key: str, shape: tuple, dtype: str = "float32", init: float | int = 0.0) -> "StateSpec":
        """The spec of state ``key`` ("{layer}.{name}"); IO names from ``state_io_names``."""
        if dtype not in DTYPES:
            raise ManifestError(f"state {key!r} has dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        if not shape or shape[0] != BATCH or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
            raise ManifestError(f"state {key!r} has shape {shape!r}; expected ({BATCH!r}, positive ints...)")
        return cls(*state_io_names(key), tuple(shape), dtype, init)

    @property
    def key(self) -> str:
        """"{layer}.{name}", e.g. "0.S": the key of this tensor in a model's state dict."""
        return self.input[len(STATE_PREFIX):] if self.input.startswith(STATE_PREFIX) else self.input

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    def concrete_shape(self, batch: int) -> tuple[int, ...]:
        return tuple(batch if d == BATCH else int(d) for d in self.shape)

    def nbytes(self, batch: int = 1) -> int:
        return math.prod(self.concrete_shape(batch)) * self.np_dtype.itemsize  # exact: no int64 overflow

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output, "shape": list(self.shape), "dtype": self.dtype, "init": self.init}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "StateSpec":
        if not isinstance(d, dict):
            raise ManifestError(f"{where} must be an object, got {_kind(d)}")
        for key in ("input", "output", "shape", "dtype", "init"):
            if key not in d:
                raise ManifestError(f"{where} has no {key!r}")
        for key in ("input", "output"):
            if not _name_ok(d[key]):
                raise ManifestError(f"{where}: {key!r} must be a non-empty name (text), got {_short(d[key])}")
        if not isinstance(d["dtype"], str) or d["dtype"] not in DTYPES:
            raise ManifestError(f"{where} has dtype {_short(d['dtype'])}; supported: {', '.join(DTYPES)}")
        shape = d["shape"]
        if not isinstance(shape, list) or not shape or not all(_dim_ok(s) for s in shape):
            raise ManifestError(
                f"{where} has shape {_short(shape)}; expected a list of positive integers (at most {MAX_DIM:,}) after {BATCH!r}"
            )
        if shape[0] != BATCH:
            raise ManifestError(f"{where} has shape {_short(shape)}; the first dim must be {BATCH!r}")
        if any(isinstance(s, str) for s in shape[1:]):
            raise ManifestError(f"{where} has shape {_short(shape)}; only the batch dim may be symbolic")
        init = d["init"]
        if d["dtype"] == "int64":
            if isinstance(init, bool) or not isinstance(init, int) or not -(2**63) <= init < 2**63:
                raise ManifestError(f"{where}: 'init' must be an int64 integer for an int64 state, got {_short(init)}")
        elif isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init):
            raise ManifestError(f"{where}: 'init' must be a finite number, got {_short(init)}")
        elif not _fits(init, d["dtype"]):
            raise ManifestError(f"{where}: 'init' {init!r} does not fit in {d['dtype']}")
        return cls(d["input"], d["output"], tuple(shape), d["dtype"], init)


@dataclass(frozen=True)
class Manifest:
    graphs: dict[str, str]
    input_ids: str
    logits: str
    states: tuple[StateSpec, ...]
    vocab_size: int
    tokenizer: dict[str, Any]
    model: dict[str, Any]
    opset: int
    precision: str
    edgelin_version: str
    source: str
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- sizes ---------------------------------------------------------------------------------
    def state_bytes(self, batch: int = 1) -> int:
        """Bytes of the whole recurrent state for ``batch`` sequences (constant in sequence length)."""
        return sum(s.nbytes(batch) for s in self.states)

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": self.format,
            "graphs": dict(self.graphs),
            "input_ids": self.input_ids,
            "logits": self.logits,
            "states": [s.to_dict() for s in self.states],
            "vocab_size": self.vocab_size,
            "tokenizer": self.tokenizer,
            "model": self.model,
            "opset": self.opset,
            "precision": self.precision,
            "edgelin_version": self.edgelin_version,
            "source": self.source,
        }
        d.update(self.extra)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST_FILE) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"{where} must hold a JSON object, got {_kind(d)}")
        if d.get("format") != FORMAT:
            raise ManifestError(
                f"{where} has format {_short(d.get('format'))}; this edgelin reads {FORMAT!r} -- re-export the model with this version"
            )
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ManifestError(f"{where} lacks field(s) {', '.join(missing)}; re-export the model")
        graphs = d["graphs"]
        if not isinstance(graphs, dict) or any(not isinstance(graphs.get(g), str) for g in GRAPHS):
            raise ManifestError(f"{where}: 'graphs' must name the files of {' and '.join(GRAPHS)}")
        for g in GRAPHS:
            if not plain_file_name(graphs[g]):
                raise ManifestError(
                    f"{where}: graphs.{g} is {_short(graphs[g])}; a graph must be a plain file name inside the export "
                    "folder (no folder, no '..', no absolute path)"
                )
        if graphs["prefill"] == graphs["decode"]:
            raise ManifestError(f"{where}: 'graphs' names one file, {graphs['prefill']!r}, for both graphs; re-export the model")
        for key in ("input_ids", "logits"):
            if not _name_ok(d[key]):
                raise ManifestError(f"{where}: {key!r} must be a non-empty name (text), got {_short(d[key])}")
        states = d["states"]
        if not isinstance(states, list):
            raise ManifestError(f"{where}: 'states' must be a list, got {_kind(states)}")
        specs = tuple(StateSpec.from_dict(s, f"{where}: states[{i}]") for i, s in enumerate(states))
        names = [d["input_ids"], d["logits"]] + [s.input for s in specs] + [s.output for s in specs]
        if len(set(names)) != len(names):
            raise ManifestError(f"{where}: input, output and state names are not unique")
        if isinstance(d["vocab_size"], bool) or not isinstance(d["vocab_size"], int) or not 1 <= d["vocab_size"] <= MAX_DIM:
            raise ManifestError(f"{where}: 'vocab_size' must be a positive integer (at most {MAX_DIM:,}), got {_short(d['vocab_size'])}")
        if not isinstance(d["tokenizer"], dict) or "kind" not in d["tokenizer"]:
            raise ManifestError(f"{where}: 'tokenizer' must be an object with a 'kind'")
        if not isinstance(d["model"], dict):
            raise ManifestError(f"{where}: 'model' must be an object (the model config), got {_kind(d['model'])}")
        if isinstance(d["opset"], bool) or not isinstance(d["opset"], int) or not 1 <= d["opset"] <= 1000:
            raise ManifestError(f"{where}: 'opset' must be an integer, got {_short(d['opset'])}")
        for key in ("precision", "edgelin_version", "source"):
            if not isinstance(d[key], str):
                raise ManifestError(f"{where}: {key!r} must be text, got {_short(d[key])}")
        extra = {k: v for k, v in d.items() if k not in REQUIRED}
        return cls(
            graphs={g: graphs[g] for g in GRAPHS}, input_ids=d["input_ids"], logits=d["logits"],
            states=specs, vocab_size=d["vocab_size"], tokenizer=dict(d["tokenizer"]), model=dict(d["model"]),
            opset=d["opset"], precision=d["precision"], edgelin_version=d["edgelin_version"],
            source=d["source"], extra=extra,
        )

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_FILE) -> "Manifest":
        return cls.from_dict(parse_json(text, where), where)

    @classmethod
    def load(cls, export_dir: str | Path) -> "Manifest":
        export_dir = Path(export_dir)
        if not export_dir.is_dir():
            raise ManifestError(f"{export_dir} is not a folder; pass the folder that `edgelin export` wrote")
        path = export_dir / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(f"{export_dir} is not an edgelin export: it has no {MANIFEST_FILE}; run `edgelin export` first")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path} is {len(data):,} bytes; a manifest is at most {MAX_MANIFEST_BYTES:,} -- re-export the model")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{path} is not UTF-8 text (byte {exc.start}); re-export the model") from None
        return cls.from_json(text, str(path))

    def graph_path(self, export_dir: str | Path, graph: str) -> Path:
        """The file of ``graph`` in ``export_dir``; ManifestError if it (through a symbolic link) lies outside."""
        export_dir = Path(export_dir)
        path = export_dir / self.graphs[graph]
        real = Path(os.path.realpath(path))
        if real.parent != Path(os.path.realpath(export_dir)):
            raise ManifestError(
                f"{path} leads outside the export folder (to {real}); a graph must be a file inside {export_dir}"
            )
        return path


# ---- strict reading helpers ----------------------------------------------------------------------
def _kind(x: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", bool: "true/false", type(None): "null"}.get(type(x), type(x).__name__)


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name_ok(x: Any) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 256 and "\x00" not in x


def _dim_ok(x: Any) -> bool:
    if isinstance(x, str):
        return _name_ok(x)
    return not isinstance(x, bool) and isinstance(x, int) and 1 <= x <= MAX_DIM


def plain_file_name(name: Any) -> bool:
    """A file name with no folder part: not empty, not '.' or '..', no '/' or '\\', no NUL."""
    return (
        isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
        and not any(c in name for c in ("/", "\\", "\x00")) and not os.path.isabs(name)
    )


def _fits(value: float, dtype: str) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.asarray(value, dtype=DTYPES[dtype])))


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: Any, where: str = MANIFEST_FILE) -> Any:
    """Strict JSON: NaN / Infinity are refused, so are nesting deep enough to exhaust the stack."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    if not isinstance(text, str):
        raise ManifestError(f"{where} must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where} is not valid JSON ({exc})") from None
    except ValueError as exc:
        raise ManifestError(f"{where} is not valid JSON ({exc})") from None
    except RecursionError:
        raise ManifestError(f"{where} is nested too deeply to be a manifest") from None


def canonical_json(text: str, where: str = MANIFEST_FILE) -> str:
    """The manifest's content in one canonical form (sorted keys, no insignificant space)."""
    return json.dumps(parse_json(text, where), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_manifest_equal(a_text: str, b_text: str) -> bool:
    """True if two manifest texts hold the same JSON content, whatever their indentation or key order.
    Text that is not valid JSON equals nothing."""
    try:
        return canonical_json(a_text) == canonical_json(b_text)
    except ManifestError:
        return False


__all__ = [
    "BATCH", "DTYPES", "FORMAT", "GRAPHS", "MANIFEST_FILE", "METADATA_KEY", "Manifest", "StateSpec", "state_io_names",
    "canonical_json", "canonical_manifest_equal", "parse_json", "plain_file_name",
]
