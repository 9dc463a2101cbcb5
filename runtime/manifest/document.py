"""The ``Manifest`` value: its fields, the state's size, the graphs' io, the checks of an export's files against it,
and its writing as JSON (checked against the schema and read back first). Reading is ``reading``'s. Standard
library + numpy only."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgelin.errors import ManifestError
from edgelin.runtime.files import file_sha256
from edgelin.runtime.manifest.contract import StateSpec
from edgelin.runtime.manifest.format import (
    FORMAT, GRAPHS, GROWING_SYMBOLS, LOGITS_AT_POSITIONS, LOGITS_LAYOUT, MANIFEST_FILE, POSITIONS_SYMBOL, PREFILL_PIECE, SYMBOLS,
    WEIGHTS,
)
from edgelin.runtime.manifest.graph_io import implied_io, positions_feed
from edgelin.runtime.manifest.reading import load_manifest, manifest_from_dict, normalize_tokenizer
from edgelin.runtime.manifest.strict import parse_json


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
        return manifest_from_dict(cls, d, where, embedded=embedded)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST_FILE, *, embedded: bool = False) -> "Manifest":
        return cls.from_dict(parse_json(text, where), where, embedded=embedded)

    @classmethod
    def load(cls, export_dir: str | Path) -> "Manifest":
        """Read ``export_dir/edgelin.json``. An edgelin/1 manifest is upgraded in memory, with a FormatWarning."""
        return load_manifest(cls, export_dir)

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
