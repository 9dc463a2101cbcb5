"""The export manifest (``edgelin.json``): everything a runtime needs to drive the two graphs.

The format lives here, in the runtime, because the runtime is what must read it on a device. Its JSON
Schema ships beside this module (``schema/edgelin-2.schema.json``; docs/manifest.md explains every field);
manifests are checked against it when written and when read. Standard library + numpy only.

    {
      "format": "edgelin/2",
      "graphs": {"prefill": "prefill.onnx", "decode": "decode.onnx"},
      "sha256": {"prefill": "<hex>", "decode": "<hex>"},
      "symbols": {"batch": "...", "sequence": "..."},
      "io": {"prefill": {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "sequence"]}, ...],
                         "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", "sequence", 256]}, ...]},
             "decode": {... the same with 1 for "sequence" ...}},
      "input_ids": "input_ids", "logits": "logits",
      "logits_layout": {"axes": ["batch", "sequence", "vocab"], "positions": "every", "next_token": "last"},
      "min_sequence": 1, "prefill_piece": 1024,
      "max_sequence": 4096,         (only where the prefill graph is exact up to a length: longer prompts go in pieces)
      "lengths": "lengths",         (only a ragged export: the prefill graph's per-row lengths, int64 [batch])
      "logits_at": "logits_at",     (the prefill graph's positions whose logits it returns, int64 [batch, positions])
      "states": [{"input": "state.0.S", "output": "present.0.S", "shape": ["batch", 4, 64, 64],
                  "dtype": "float32", "init": 0.0}, ...],
      "vocab_size": 256,
      "tokenizer": {"kind": "bytes", "encoding": "utf-8", "offset": 0, "bos_id": null, "eos_id": null, "pad_id": null},
      "model": {...config...}, "opset": 18, "precision": "fp32", "edgelin_version": "0.1.0",
      "source": "<sha256 of the weights>",
      ... extension fields (chunk_size, nodes, state_bytes_per_sequence) ...
    }

An ``edgelin/1`` manifest (no io, symbols, hashes, layout; tokenizer ``{"kind": "bytes"}``) is still read:
it is upgraded in memory and ``Manifest.load`` warns (``FormatWarning``).

``lengths`` is optional in edgelin/2: a manifest without it (every export before ragged prefill, and every
export made without ``--ragged``) describes a prefill graph that takes input_ids and states only, and is
written without the field, exactly as before. With it, the prefill graph takes a third kind of input:
right-padded rows of different lengths in one call, each row's state as if prefilled alone.

``logits_at`` is optional too: without it (every export before the field) the prefill graph returns the logits
of every position, [batch, sequence, vocab] (``logits_layout.positions`` "every"). With it (positions
"logits_at") the prefill graph takes int64 [batch, positions] after ``lengths`` and returns the logits of those
positions only, [batch, positions, vocab]: a runtime asks for the last position of a prompt, and the head runs
on one row instead of every one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.files import check_path, read_regular
from edgelin.runtime.schema import json_equal
from edgelin.runtime.schema import validate as validate_schema

FORMAT = "edgelin/2"
FORMAT_V1 = "edgelin/1"  # still read, upgraded in memory
MANIFEST_FILE = "edgelin.json"
METADATA_KEY = "edgelin"  # key of the manifest in each graph's metadata_props
BATCH = "batch"
PAST = "past"  # a growing state's (a KV cache's) positions: 0 for a fresh sequence
PRESENT = "present"  # a growing state's positions after a call: past + the call's tokens, at most its window
STATE_PREFIX, PRESENT_PREFIX = "state.", "present."  # graph input / output name of the state with key K
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
GRAPHS = ("prefill", "decode")
MAX_DIM = 1 << 31  # a fixed dim or vocabulary size beyond this is a corrupt manifest
MAX_MANIFEST_BYTES = 16 << 20
REQUIRED_V1 = (
    "format", "graphs", "input_ids", "logits", "states", "vocab_size", "tokenizer",
    "model", "opset", "precision", "edgelin_version", "source",
)
DROPPED_V1 = ("weights_file",)  # named a file that is not in the export
FIELDS = REQUIRED_V1 + ("sha256", "symbols", "io", "logits_layout", "min_sequence", "prefill_piece", "max_sequence", "lengths", "logits_at", "max_positions", "weights")
WEIGHTS = "weights"  # the key of the weights file's hash in ``sha256``
SEQUENCE = "sequence"
POSITIONS = "positions"  # the prefill graph's logits_at: how many positions' logits one call returns
LOGITS_AT = "logits_at"  # the name edgelin's exports give that input (a manifest may name it otherwise)
SYMBOLS = {
    BATCH: "sequences run together (>= 1); the same for every input and output of one call",
    SEQUENCE: "tokens in one prefill call (>= min_sequence); decode takes exactly 1",
}
GROWING_SYMBOLS = {  # in "symbols" only when a state grows
    PAST: "positions a growing state (a KV cache) holds before a call: 0 for a fresh sequence; the same for "
          "every growing state and row of one call (rows of different lengths are left-padded, see docs/manifest.md)",
    PRESENT: "positions a growing state holds after a call: past + the call's tokens, at most the state's window",
}
POSITIONS_SYMBOL = {  # in "symbols" only when the prefill graph takes logits_at
    POSITIONS: "positions of a prefill call whose logits it returns (logits_at; 1 for a prompt's next token)",
}
SEQUENCE_DIM = {"prefill": SEQUENCE, "decode": 1}  # the token dim of input_ids and logits, per graph
LOGITS_LAYOUT = {"axes": (BATCH, SEQUENCE, "vocab"), "positions": "every", "next_token": "last"}
LOGITS_AT_POSITIONS = "logits_at"  # logits_layout.positions of an export whose prefill graph takes logits_at
LOGITS_DTYPES = ("float32", "float16")
TOKEN_INTS = ("offset", "bos_id", "eos_id", "pad_id")
# tokenizer fields beyond the six every manifest has; a 'huggingface' tokenizer has them all
TOKENIZER_OPTIONAL = ("eos_ids", "add_bos", "skip_special_tokens", "files")
HUGGINGFACE = "huggingface"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
PREFILL_PIECE = 1024  # the runtime's default longest prefill call (tokens); bounds memory for any prompt length
HASH_BLOCK = 1 << 20


def state_key(layer: int, name: str) -> str:
    """The one place a (layer index, state name) pair becomes a state key, e.g. (0, "S") -> "0.S"."""
    return f"{layer}.{name}"


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
    window: int | None = None  # a growing state only: the most positions it keeps (None: all)

    @classmethod
    def for_key(cls, key: str, shape: tuple, dtype: str = "float32", init: float | int = 0.0, window: int | None = None) -> "StateSpec":
        """The spec of state ``key`` ("{layer}.{name}"); IO names from ``state_io_names``."""
        if dtype not in DTYPES:
            raise ManifestError(f"state {key!r} has dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        if not shape or shape[0] != BATCH or not all((isinstance(d, int) and d > 0) or d == PAST for d in shape[1:]):
            raise ManifestError(f"state {key!r} has shape {shape!r}; expected ({BATCH!r}, positive ints or {PAST!r}...)")
        if window is not None and (PAST not in shape or isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ManifestError(f"state {key!r}: a window (positive int) belongs to a growing state (shape with {PAST!r}), got {window!r}")
        return cls(*state_io_names(key), tuple(shape), dtype, init, window)

    @property
    def key(self) -> str:
        """"{layer}.{name}", e.g. "0.S": the key of this tensor in a model's state dict."""
        return self.input[len(STATE_PREFIX):] if self.input.startswith(STATE_PREFIX) else self.input

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def grows(self) -> bool:
        """True for a state that grows along the sequence (a KV cache): its shape has the "past" dim."""
        return PAST in self.shape

    def concrete_shape(self, batch: int, past: int = 0) -> tuple[int, ...]:
        """The shape for ``batch`` sequences holding ``past`` positions (a growing state; 0: a fresh one)."""
        return tuple(batch if d == BATCH else past if d == PAST else int(d) for d in self.shape)

    def nbytes(self, batch: int = 1, past: int = 0) -> int:
        return math.prod(self.concrete_shape(batch, past)) * self.np_dtype.itemsize  # exact: no int64 overflow

    def to_dict(self) -> dict[str, Any]:
        d = {"input": self.input, "output": self.output, "shape": list(self.shape), "dtype": self.dtype, "init": self.init}
        return d if self.window is None else {**d, "window": self.window}

    def present_length(self, past: int, tokens: int) -> int:
        """Positions a growing state holds after a call of ``tokens`` tokens from ``past``."""
        n = past + tokens
        return n if self.window is None else min(n, self.window)

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
        if any(isinstance(s, str) and s != PAST for s in shape[1:]):
            raise ManifestError(f"{where} has shape {_short(shape)}; only the batch dim and {PAST!r} may be symbolic")
        init = d["init"]
        if d["dtype"] == "int64":
            if isinstance(init, bool) or not isinstance(init, int) or not -(2**63) <= init < 2**63:
                raise ManifestError(f"{where}: 'init' must be an int64 integer for an int64 state, got {_short(init)}")
        elif isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init):
            raise ManifestError(f"{where}: 'init' must be a finite number, got {_short(init)}")
        elif not _fits(init, d["dtype"]):
            raise ManifestError(f"{where}: 'init' {init!r} does not fit in {d['dtype']}")
        window = d.get("window")
        if window is not None and (PAST not in shape or not _dim_ok(window) or isinstance(window, str)):
            raise ManifestError(f"{where}: 'window' must be a positive integer on a state whose shape has {PAST!r}, got {_short(window)}")
        if shape.count(PAST) > 1:
            raise ManifestError(f"{where} has shape {_short(shape)}; {PAST!r} may appear once")
        return cls(d["input"], d["output"], tuple(shape), d["dtype"], init, window)


class FormatWarning(UserWarning):
    """An export in an older manifest format was read and upgraded in memory."""


def tensor(name: str, dtype: str, shape: list) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def normalize_tokenizer(spec: Any, where: str = "tokenizer") -> dict[str, Any]:
    """A tokenizer entry in the edgelin/2 form: kind, encoding, offset, bos/eos/pad ids (null if none).
    ``{"kind": "bytes"}`` (edgelin/1, or a model's own short form) becomes UTF-8 bytes at offset 0."""
    if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
        raise ManifestError(f"{where} must be an object with a 'kind'")
    kind = spec["kind"]
    out = {"kind": kind, "encoding": "utf-8" if kind == "bytes" else None, "offset": 0, "bos_id": None, "eos_id": None, "pad_id": None}
    unknown = sorted(set(spec) - set(out) - set(TOKENIZER_OPTIONAL))
    if unknown:
        raise ManifestError(f"{where} has unknown field(s) {', '.join(map(str, unknown))}; known: {', '.join(list(out) + list(TOKENIZER_OPTIONAL))}")
    out.update(spec)  # the optional fields stay absent where not given: such a manifest is written as before they existed
    return out


REEXPORT = "; re-export the model"


def join_problems(problems: list[str]) -> str:
    """``file_problems`` as one line: the problems in turn, the advice to re-export said once, at the end."""
    advice = any(p.endswith(REEXPORT) for p in problems)
    return "; ".join(p[: -len(REEXPORT)] if p.endswith(REEXPORT) else p for p in problems) + (REEXPORT if advice else "")


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
    sha256: dict[str, str] | None = None  # graph -> sha256 of its file; None in the copy a graph embeds, or read from edgelin/1
    logits_dtype: str = "float32"
    min_sequence: int = 1
    prefill_piece: int = PREFILL_PIECE
    max_sequence: int | None = None  # the most tokens one prefill call takes (the graph is exact up to it); None: any
    lengths: str | None = None  # the ragged prefill graph's per-row lengths input, int64 [batch]; None: no such input
    logits_at: str | None = None  # the prefill graph's positions input, int64 [batch, positions]; None: every position's logits
    max_positions: int | None = None  # the context limit the model declares (positions per sequence); None: none
    weights: dict[str, Any] | None = None  # {"file", "bytes"}: the graphs' one external-data file; None: weights inside each graph
    read_from: str = field(default=FORMAT, compare=False)  # the format the manifest was read in (edgelin/1 is upgraded)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokenizer", normalize_tokenizer(self.tokenizer))

    # ---- sizes ---------------------------------------------------------------------------------
    def state_bytes(self, batch: int = 1, past: int = 0) -> int:
        """Bytes of the whole state for ``batch`` sequences; a growing state (KV cache) at ``past`` positions (its
        window at most). Without a growing state the size is the same at any length."""
        return sum(s.nbytes(batch, past if s.window is None else min(past, s.window)) for s in self.states)

    @property
    def grows(self) -> bool:
        """True when some state grows with the sequence (a KV cache): the state's size depends on the context."""
        return any(s.grows for s in self.states)

    def state_summary(self) -> str:
        """The state of one sequence in words, as ``edgelin export`` and ``edgelin web`` print it: its bytes, and with a
        KV cache what each position of context adds (and the total at 4,096 positions or the declared context)."""
        if not self.grows:
            return f"{self.state_bytes(1):,} bytes (constant in sequence length)"
        fixed, per = self.state_bytes(1), self.state_bytes(1, 1) - self.state_bytes(1)
        at = min(4096, self.max_positions or 4096)
        return (f"{fixed:,} bytes + {per:,} bytes per position of context ({self.state_bytes(1, at):,} bytes at {at:,}; "
                "KV caches grow with the context)")

    # ---- the graphs' inputs and outputs --------------------------------------------------------
    def io(self, graph: str) -> dict[str, list[dict[str, Any]]]:
        """Every input and output of ``graph`` ("prefill" or "decode"): name, dtype, shape, in graph order."""
        return implied_io(graph, self.input_ids, self.logits, self.logits_dtype, self.vocab_size,
                        [s.to_dict() for s in self.states], self.lengths, self.logits_at)

    def prefill_positions(self, batch: int, tokens: int, *, last: bool = False) -> dict[str, np.ndarray]:
        """What a prefill call of ``batch`` rows of ``tokens`` feeds besides ids, lengths and states: the graph's
        ``logits_at`` (every position, or ``last`` only), or nothing for an export without it."""
        return {} if self.logits_at is None else {self.logits_at: positions_feed(batch, tokens, last)}

    def with_hashes(self, export_dir: str | Path) -> "Manifest":
        """This manifest with the sha256 of the graph files (and the weights file) in ``export_dir``."""
        hashes = {g: file_sha256(Path(export_dir) / self.graphs[g]) for g in GRAPHS}
        if self.weights is not None:
            hashes[WEIGHTS] = file_sha256(Path(export_dir) / self.weights["file"])
        return replace(self, sha256=hashes)

    def weights_problems(self, export_dir: str | Path, *, hashes: bool = True) -> list[str]:
        """What is wrong with the weights file: missing, of another size than the manifest says (truncated, or
        another export's), or (``hashes``) of another sha256. None when the weights are inside the graphs."""
        if self.weights is None:
            return []
        path = self.weights_path(export_dir)
        name = self.weights["file"]
        if not path.is_file():
            return [f"{absent(path, name, 'it')}, the weights file named in edgelin.json (copy the whole export folder, or re-export the model)"]
        size = path.stat().st_size
        if size != self.weights["bytes"]:
            return [f"{name} is {size:,} bytes but edgelin.json says {self.weights['bytes']:,} (truncated, or the weights of "
                    "another export); copy the whole export folder again, or re-export the model"]
        if hashes and self.sha256 is not None and file_sha256(path) != self.sha256[WEIGHTS]:
            return [f"{name} is not the weights file edgelin.json describes (its sha256 differs: the weights of another export, "
                    "or changed since); re-export the model"]
        return []

    def file_problems(self, export_dir: str | Path) -> list[str]:
        """Graph and weights files whose sha256 differs from the manifest's (none when the manifest has no hashes)."""
        if self.sha256 is None:
            return []
        problems = self.weights_problems(export_dir)
        for g in GRAPHS:
            path = self.graph_path(export_dir, g)
            if not path.is_file():
                continue
            digest = file_sha256(path)
            if digest == self.sha256[g]:
                continue
            other = [o for o in GRAPHS if o != g and self.sha256.get(o) == digest]
            if other:
                problems.append(f"{path.name} is the {other[0]} graph but edgelin.json names it as the {g} graph (were the files swapped or renamed?)")
            else:
                problems.append(f"{path.name} is not the file edgelin.json describes (its sha256 differs: a graph from another export, "
                                "or changed since); re-export the model")
        return problems

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self, *, embedded: bool = False) -> dict[str, Any]:
        """The manifest as JSON data. ``embedded``: the copy stored in each graph's metadata (no ``sha256``)."""
        d = {
            "format": FORMAT,
            "graphs": dict(self.graphs),
            "sha256": None if self.sha256 is None else dict(self.sha256),
            "symbols": dict(SYMBOLS) | (GROWING_SYMBOLS if self.grows else {}) | (POSITIONS_SYMBOL if self.logits_at else {}),
            "io": {g: self.io(g) for g in GRAPHS},
            "input_ids": self.input_ids,
            "logits": self.logits,
            "logits_layout": dict(LOGITS_LAYOUT, axes=list(LOGITS_LAYOUT["axes"]))
            | ({} if self.logits_at is None else {"positions": LOGITS_AT_POSITIONS}),
            "min_sequence": self.min_sequence,
            "prefill_piece": self.prefill_piece,
            **({} if self.max_sequence is None else {"max_sequence": self.max_sequence}),
            **({} if self.lengths is None else {"lengths": self.lengths}),  # absent: written exactly as before
            **({} if self.logits_at is None else {"logits_at": self.logits_at}),
            **({} if self.max_positions is None else {"max_positions": self.max_positions}),
            **({} if self.weights is None else {"weights": dict(self.weights)}),
            "states": [s.to_dict() for s in self.states],
            "vocab_size": self.vocab_size,
            "tokenizer": dict(self.tokenizer),
            "model": self.model,
            "opset": self.opset,
            "precision": self.precision,
            "edgelin_version": self.edgelin_version,
            "source": self.source,
        }
        if embedded or self.sha256 is None:
            del d["sha256"]
        d.update(self.extra)
        return d

    def to_json(self, *, embedded: bool = False) -> str:
        """The manifest as JSON text, checked against the schema and the reader first (ManifestError if
        it would not read back). edgelin.json needs the graph hashes: see ``with_hashes``."""
        if not embedded and self.sha256 is None:
            raise ManifestError("this manifest has no graph hashes (sha256); add them with with_hashes(export_dir) before writing edgelin.json")
        d = self.to_dict(embedded=embedded)
        Manifest.from_dict(json.loads(json.dumps(d)), "the manifest being written", embedded=embedded)
        return json.dumps(d, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST_FILE, *, embedded: bool = False) -> "Manifest":
        """Read a manifest: edgelin/2 is checked against the schema, then for what a schema cannot say
        (unique names, io equal to what the states imply, init values that fit their dtype); edgelin/1
        is read strictly and upgraded in memory (``read_from`` tells). ``embedded``: the graph-metadata
        copy, which has no ``sha256``."""
        if not isinstance(d, dict):
            raise ManifestError(f"{where} must hold a JSON object, got {_kind(d)}")
        if d.get("format") == FORMAT_V1:
            return _from_v1(d, where)
        if d.get("format") != FORMAT:
            raise ManifestError(
                f"{where} has format {_short(d.get('format'))}; this edgelin reads {FORMAT!r} and {FORMAT_V1!r} -- re-export the model with this version"
            )
        _from_v1(d, where)  # the fields edgelin/1 had, with the messages it gave; then the schema for all the rest
        hashes_given = "sha256" in d
        checked = d if (hashes_given or not embedded) else {**d, "sha256": {g: "0" * 64 for g in GRAPHS}}
        errors = validate_schema(checked)
        if errors:
            raise ManifestError(f"{where} does not follow the {FORMAT} schema: {'; '.join(errors)} -- re-export the model")
        for g in GRAPHS:  # the schema's file pattern cannot say "not an absolute path" on every system
            if not plain_file_name(d["graphs"][g]):
                raise ManifestError(f"{where}: graphs.{g} is {_short(d['graphs'][g])}; a graph must be a plain file name inside the export folder")
        if d["graphs"]["prefill"] == d["graphs"]["decode"]:
            raise ManifestError(f"{where}: 'graphs' names one file, {d['graphs']['prefill']!r}, for both graphs; re-export the model")
        weights = d.get("weights")
        if weights is not None:
            if not plain_file_name(weights["file"]) or weights["file"] in d["graphs"].values() or weights["file"] == MANIFEST_FILE:
                raise ManifestError(f"{where}: weights.file is {_short(weights['file'])}; it must be a plain file name inside the export "
                                    "folder, other than the graphs and edgelin.json -- re-export the model")
            weights = {"file": weights["file"], "bytes": _int(weights["bytes"])}
        if hashes_given and (WEIGHTS in d["sha256"]) != (weights is not None):
            raise ManifestError(f"{where}: sha256.weights must be given exactly when 'weights' is; re-export the model")
        states = []
        for i, s in enumerate(d["states"]):
            s = dict(s, shape=[_int(x) for x in s["shape"]])
            if s["dtype"] == "int64" and isinstance(s["init"], float) and s["init"].is_integer() and abs(s["init"]) < 2**64:
                s["init"] = int(s["init"])
            states.append(StateSpec.from_dict(s, f"{where}: states[{i}]"))
        vocab = _int(d["vocab_size"])
        lengths, logits_at = d.get("lengths"), d.get("logits_at")
        names = ([d["input_ids"], d["logits"]] + [s.input for s in states] + [s.output for s in states]
                 + [n for n in (lengths, logits_at) if n is not None])
        if len(set(names)) != len(names):
            raise ManifestError(f"{where}: input, output and state names are not unique")
        if (d["logits_layout"]["positions"] == LOGITS_AT_POSITIONS) != (logits_at is not None) or (POSITIONS in d["symbols"]) != (logits_at is not None):
            raise ManifestError(f"{where}: logits_layout.positions is 'logits_at' and symbols has 'positions' exactly when the manifest "
                                "names a logits_at input; re-export the model")
        logits_out = d["io"]["prefill"]["outputs"][0] if d["io"]["prefill"]["outputs"] else {}
        logits_dtype = logits_out.get("dtype")
        if logits_dtype not in LOGITS_DTYPES:
            raise ManifestError(f"{where}: the logits must be one of {', '.join(LOGITS_DTYPES)}, io says {_short(logits_dtype)}")
        tok = dict(d["tokenizer"], **{k: _int(v) for k, v in d["tokenizer"].items() if k in TOKEN_INTS and v is not None})
        if "eos_ids" in tok:
            tok["eos_ids"] = [_int(i) for i in tok["eos_ids"]]
        _check_tokenizer(tok, vocab, where)
        extra = {k: v for k, v in d.items() if k not in FIELDS}
        m = cls(
            graphs=dict(d["graphs"]), input_ids=d["input_ids"], logits=d["logits"], states=tuple(states),
            vocab_size=vocab, tokenizer=tok, model=dict(d["model"]), opset=_int(d["opset"]),
            precision=d["precision"], edgelin_version=d["edgelin_version"], source=d["source"], extra=extra,
            sha256=dict(d["sha256"]) if hashes_given else None, logits_dtype=logits_dtype,
            min_sequence=_int(d["min_sequence"]), prefill_piece=_int(d["prefill_piece"]), lengths=lengths, logits_at=logits_at,
            max_sequence=None if d.get("max_sequence") is None else _int(d["max_sequence"]),
            max_positions=None if d.get("max_positions") is None else _int(d["max_positions"]), weights=weights,
        )
        if m.max_sequence is not None and m.max_sequence < m.min_sequence:
            raise ManifestError(f"{where}: max_sequence ({m.max_sequence}) is below min_sequence ({m.min_sequence}); re-export the model")
        for g in GRAPHS:
            if not json_equal(d["io"][g], m.io(g)):
                raise ManifestError(
                    f"{where}: io.{g} does not list what input_ids, lengths, logits_at, logits, vocab_size and states imply "
                    f"({_short(d['io'][g], 80)}); re-export the model"
                )
        return m

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_FILE, *, embedded: bool = False) -> "Manifest":
        return cls.from_dict(parse_json(text, where), where, embedded=embedded)

    @classmethod
    def load(cls, export_dir: str | Path) -> "Manifest":
        """Read ``export_dir/edgelin.json``. An edgelin/1 manifest is upgraded in memory, with a FormatWarning."""
        export_dir = check_path(export_dir, "export folder", ManifestError)
        if not export_dir.is_dir():
            raise ManifestError(f"{export_dir} is not a folder; pass the folder that `edgelin export` wrote")
        path = export_dir / MANIFEST_FILE
        if not path.exists() and not path.is_symlink():
            raise ManifestError(f"{export_dir} is not an edgelin export: it has no {MANIFEST_FILE}; run `edgelin export` first")
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
        if path.is_file() and size > MAX_MANIFEST_BYTES:  # checked before a byte is read
            raise ManifestError(f"{path} is {size:,} bytes; a manifest is at most {MAX_MANIFEST_BYTES:,} -- re-export the model")
        try:
            data = read_regular(path, MAX_MANIFEST_BYTES, "manifest")  # a regular file, never a FIFO or a device
        except RuntimeInputError as exc:
            raise ManifestError(f"{exc}; pass the folder that `edgelin export` wrote") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(f"{path} is not UTF-8 text (byte {exc.start}); re-export the model") from None
        m = cls.from_json(text, str(path))
        if m.read_from != FORMAT:
            warnings.warn(
                f"{path} is in the older format {m.read_from}; read as {FORMAT} in memory (its graph files have no "
                "hashes to check) -- re-export the model to upgrade it", FormatWarning, stacklevel=2,
            )
        return m

    def graph_path(self, export_dir: str | Path, graph: str) -> Path:
        """The file of ``graph`` in ``export_dir``; ManifestError if it (through a symbolic link) lies outside."""
        return _inside(export_dir, self.graphs[graph], "a graph")

    def weights_path(self, export_dir: str | Path) -> Path:
        """The weights file in ``export_dir`` (only when the manifest has one); ManifestError if it leads outside."""
        return _inside(export_dir, self.weights["file"], "the weights")


def absent(path: Path, name: str, folder: str) -> str:
    """Why ``path`` (the file ``name`` of an export ``folder``) is not a regular file: "{folder} lacks {name}", or what
    stands in its place (a folder, a FIFO, a link to nothing)."""
    if path.is_dir():
        return f"{folder} has a folder in place of {name}"
    if path.is_symlink() and not path.exists():
        return f"{folder} has a symbolic link to nothing in place of {name}"
    if path.exists():
        return f"{folder} has a FIFO, device or socket in place of {name}"
    return f"{folder} lacks {name}"


def _inside(export_dir: str | Path, name: str, what: str) -> Path:
    export_dir = Path(export_dir)
    path = export_dir / name
    real = Path(os.path.realpath(path))
    if real.parent != Path(os.path.realpath(export_dir)):
        raise ManifestError(f"{path} leads outside the export folder (to {real}); {what} must be a file inside {export_dir}")
    return path


def implied_io(graph: str, input_ids: str, logits: str, logits_dtype: str, vocab: int, states: list[dict], lengths: str | None,
               logits_at: str | None = None) -> dict[str, list]:
    """The io of ``graph`` implied by the manifest fields (states as dicts): input_ids, the prefill graph's
    lengths and logits_at if any, every state input; logits (of the asked positions, where logits_at is), every
    state output."""
    seq = SEQUENCE_DIM[graph]
    prefill = graph == "prefill"
    ragged = [tensor(lengths, "int64", [BATCH])] if lengths is not None and prefill else []
    picked = [tensor(logits_at, "int64", [BATCH, POSITIONS])] if logits_at is not None and prefill else []
    return {
        "inputs": [tensor(input_ids, "int64", [BATCH, seq])] + ragged + picked + [tensor(s["input"], s["dtype"], s["shape"]) for s in states],
        "outputs": [tensor(logits, logits_dtype, [BATCH, POSITIONS if picked else seq, vocab])]
        + [tensor(s["output"], s["dtype"], [PRESENT if d == PAST else d for d in s["shape"]]) for s in states],
    }


def positions_feed(batch: int, tokens: int, last: bool = False) -> np.ndarray:
    """The prefill graph's ``logits_at`` for ``batch`` rows of ``tokens``: every position, int64 [batch, tokens],
    or (``last``) the last one only, [batch, 1]."""
    row = np.array([tokens - 1], dtype=np.int64) if last else np.arange(tokens, dtype=np.int64)
    return np.ascontiguousarray(np.broadcast_to(row, (batch, row.size)))


def sync_io(d: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the ``io`` of a manifest dict from its input_ids, lengths, logits_at, logits, vocab_size and states, in
    place (for tools and tests that edit a manifest by hand); the logits dtype is kept. Returns ``d``."""
    logits_dtype = d.get("io", {}).get("prefill", {}).get("outputs", [{}])[0].get("dtype", "float32")
    for g in SEQUENCE_DIM:
        d.setdefault("io", {})[g] = implied_io(g, d["input_ids"], d["logits"], logits_dtype, d["vocab_size"], d["states"], d.get("lengths"),
                                       d.get("logits_at"))
    return d


def _int(x: Any) -> int:
    """A JSON integer (the schema already said so): 4.0 is 4."""
    return int(x) if not isinstance(x, str) else x


def _check_tokenizer(tok: dict[str, Any], vocab: int, where: str) -> None:
    if tok["kind"] == "bytes":
        if tok["encoding"] != "utf-8":
            raise ManifestError(f"{where}: a 'bytes' tokenizer needs encoding 'utf-8', got {_short(tok['encoding'])}")
        if tok["offset"] + 256 > vocab:
            raise ManifestError(f"{where}: a 'bytes' tokenizer at offset {tok['offset']} needs a vocabulary of {tok['offset'] + 256}, vocab_size is {vocab}")
    for key in ("bos_id", "eos_id", "pad_id"):
        if tok[key] is not None and tok[key] >= vocab:
            raise ManifestError(f"{where}: tokenizer {key} {tok[key]} is outside the vocabulary [0, {vocab})")
    eos_ids = tok.get("eos_ids")
    if eos_ids is not None:
        for i in eos_ids:
            if i >= vocab:
                raise ManifestError(f"{where}: tokenizer eos_ids holds {i}, outside the vocabulary [0, {vocab})")
        if (tok["eos_id"] is None) != (not eos_ids) or (eos_ids and eos_ids[0] != tok["eos_id"]):
            raise ManifestError(f"{where}: tokenizer eos_ids {eos_ids} must begin with eos_id {tok['eos_id']} (and be empty when it is null)")
    if tok["kind"] == HUGGINGFACE:
        missing = [k for k in TOKENIZER_OPTIONAL if k not in tok]
        if missing:
            raise ManifestError(f"{where}: a 'huggingface' tokenizer needs {', '.join(missing)}; re-export the model")
        if tok["add_bos"] and tok["bos_id"] is None:
            raise ManifestError(f"{where}: the tokenizer has add_bos true but bos_id null; re-export the model")
    elif "files" in tok or "add_bos" in tok:
        raise ManifestError(f"{where}: only a 'huggingface' tokenizer has 'files' and 'add_bos', this one is {tok['kind']!r}")


def _from_v1(d: dict[str, Any], where: str) -> Manifest:
    """An edgelin/1 manifest, read strictly as before, upgraded to the edgelin/2 model in memory."""
    missing = [k for k in REQUIRED_V1 if k not in d]
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
    if not isinstance(d["tokenizer"], dict) or not isinstance(d["tokenizer"].get("kind"), str):
        raise ManifestError(f"{where}: 'tokenizer' must be an object with a 'kind'")
    tok = dict(d["tokenizer"])
    eos = tok.get("eos_id")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
        raise ManifestError(f"{where}: tokenizer 'eos_id' must be a non-negative integer, got {_short(eos)}")
    tok = {k: v for k, v in tok.items() if k in ("kind", "eos_id")}  # edgelin/1 knew no other tokenizer fields
    if not isinstance(d["model"], dict):
        raise ManifestError(f"{where}: 'model' must be an object (the model config), got {_kind(d['model'])}")
    if isinstance(d["opset"], bool) or not isinstance(d["opset"], int) or not 1 <= d["opset"] <= 1000:
        raise ManifestError(f"{where}: 'opset' must be an integer, got {_short(d['opset'])}")
    for key in ("precision", "edgelin_version", "source"):
        if not isinstance(d[key], str):
            raise ManifestError(f"{where}: {key!r} must be text, got {_short(d[key])}")
    extra = {k: v for k, v in d.items() if k not in REQUIRED_V1 and k not in DROPPED_V1}
    return Manifest(
        graphs={g: graphs[g] for g in GRAPHS}, input_ids=d["input_ids"], logits=d["logits"],
        states=specs, vocab_size=d["vocab_size"], tokenizer=tok, model=dict(d["model"]),
        opset=d["opset"], precision=d["precision"], edgelin_version=d["edgelin_version"],
        source=d["source"], extra=extra, read_from=FORMAT_V1,
    )


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


def file_sha256(path: str | Path) -> str:
    """sha256 (lowercase hex) of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            h.update(block)
    return h.hexdigest()


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
    "BATCH", "DTYPES", "FORMAT", "HUGGINGFACE", "TOKENIZER_FILES", "FORMAT_V1", "GRAPHS", "MANIFEST_FILE", "METADATA_KEY", "LOGITS_AT", "POSITIONS", "PREFILL_PIECE", "SEQUENCE",
    "SEQUENCE_DIM", "FormatWarning", "Manifest", "StateSpec", "state_io_names", "state_key", "canonical_json", "canonical_manifest_equal",
    "absent", "file_sha256", "join_problems", "normalize_tokenizer", "parse_json", "plain_file_name", "positions_feed", "sync_io",
]
