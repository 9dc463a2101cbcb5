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
        return int(np.prod(self.concrete_shape(batch))) * self.np_dtype.itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "output": self.output, "shape": list(self.shape), "dtype": self.dtype, "init": self.init}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "StateSpec":
        if not isinstance(d, dict):
            raise ManifestError(f"{where} must be an object")
        for key in ("input", "output", "shape", "dtype", "init"):
            if key not in d:
                raise ManifestError(f"{where} has no {key!r}")
        if d["dtype"] not in DTYPES:
            raise ManifestError(f"{where} has dtype {d['dtype']!r}; supported: {', '.join(DTYPES)}")
        shape = d["shape"]
        if not isinstance(shape, list) or not all((isinstance(s, int) and s > 0) or isinstance(s, str) for s in shape):
            raise ManifestError(f"{where} has shape {shape!r}; expected a list of positive ints and symbolic names")
        if shape[:1] != [BATCH]:
            raise ManifestError(f"{where} has shape {shape!r}; the first dim must be {BATCH!r}")
        if any(isinstance(s, str) for s in shape[1:]):
            raise ManifestError(f"{where} has shape {shape!r}; only the batch dim may be symbolic")
        return cls(str(d["input"]), str(d["output"]), tuple(shape), d["dtype"], d["init"])


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
            raise ManifestError(f"{where} must hold a JSON object")
        if d.get("format") != FORMAT:
            raise ManifestError(
                f"{where} has format {d.get('format')!r}; this edgelin reads {FORMAT!r} -- re-export the model with this version"
            )
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ManifestError(f"{where} lacks field(s) {', '.join(missing)}; re-export the model")
        graphs = d["graphs"]
        if not isinstance(graphs, dict) or any(not isinstance(graphs.get(g), str) for g in GRAPHS):
            raise ManifestError(f"{where}: 'graphs' must name the files of {' and '.join(GRAPHS)}")
        states = d["states"]
        if not isinstance(states, list):
            raise ManifestError(f"{where}: 'states' must be a list")
        specs = tuple(StateSpec.from_dict(s, f"{where}: states[{i}]") for i, s in enumerate(states))
        names = [s.input for s in specs] + [s.output for s in specs]
        if len(set(names)) != len(names):
            raise ManifestError(f"{where}: state names are not unique")
        if not isinstance(d["vocab_size"], int) or d["vocab_size"] < 1:
            raise ManifestError(f"{where}: 'vocab_size' must be a positive integer, got {d['vocab_size']!r}")
        if not isinstance(d["tokenizer"], dict) or "kind" not in d["tokenizer"]:
            raise ManifestError(f"{where}: 'tokenizer' must be an object with a 'kind'")
        extra = {k: v for k, v in d.items() if k not in REQUIRED}
        return cls(
            graphs={g: graphs[g] for g in GRAPHS}, input_ids=str(d["input_ids"]), logits=str(d["logits"]),
            states=specs, vocab_size=d["vocab_size"], tokenizer=dict(d["tokenizer"]), model=dict(d["model"]),
            opset=int(d["opset"]), precision=str(d["precision"]), edgelin_version=str(d["edgelin_version"]),
            source=str(d["source"]), extra=extra,
        )

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_FILE) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where} is not valid JSON ({exc})") from None
        return cls.from_dict(data, where)

    @classmethod
    def load(cls, export_dir: str | Path) -> "Manifest":
        export_dir = Path(export_dir)
        if not export_dir.is_dir():
            raise ManifestError(f"{export_dir} is not a folder; pass the folder that `edgelin export` wrote")
        path = export_dir / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(f"{export_dir} is not an edgelin export: it has no {MANIFEST_FILE}; run `edgelin export` first")
        return cls.from_json(path.read_text(encoding="utf-8"), str(path))

    def graph_path(self, export_dir: str | Path, graph: str) -> Path:
        return Path(export_dir) / self.graphs[graph]


__all__ = ["BATCH", "DTYPES", "FORMAT", "GRAPHS", "MANIFEST_FILE", "METADATA_KEY", "Manifest", "StateSpec", "state_io_names"]
