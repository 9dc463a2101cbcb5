"""The export manifest (``edgelin.json``): everything a runtime needs to drive the two graphs.

The format lives here, in the runtime, because the runtime is what must read it on a device. Its JSON
Schema ships beside this package (``schema/edgelin-2.schema.json``; docs/manifest.md explains every field);
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

The package: ``format`` (names and fixed values), ``contract`` (the state contract: ``state_key``,
``state_io_names``, ``StateSpec``), ``strict`` (strict JSON and the field checks readers share), ``graph_io``
(the graphs' io the fields imply), ``reading`` (from JSON, edgelin/1 upgraded, the tokenizer entry checked,
``edgelin.json`` loaded) and ``document`` (the ``Manifest`` value and its writing). Import from this package.
"""

from __future__ import annotations

from edgelin.runtime.files import file_sha256
from edgelin.runtime.manifest.contract import StateSpec, state_io_names, state_key
from edgelin.runtime.manifest.document import Manifest, absent, join_problems
from edgelin.runtime.manifest.format import (
    BATCH, DTYPES, FORMAT, FORMAT_V1, GRAPHS, HUGGINGFACE, LOGITS_AT, MANIFEST_FILE, METADATA_KEY, PAST, POSITIONS, PREFILL_PIECE,
    SEQUENCE, SEQUENCE_DIM, STATE_PREFIX, TOKENIZER_FILES,
)
from edgelin.runtime.manifest.graph_io import positions_feed, sync_io
from edgelin.runtime.manifest.reading import FormatWarning, normalize_tokenizer
from edgelin.runtime.manifest.strict import canonical_json, canonical_manifest_equal, parse_json, plain_file_name

__all__ = [
    "BATCH", "DTYPES", "FORMAT", "HUGGINGFACE", "TOKENIZER_FILES", "FORMAT_V1", "GRAPHS", "MANIFEST_FILE", "METADATA_KEY", "LOGITS_AT", "PAST",
    "POSITIONS", "PREFILL_PIECE", "SEQUENCE", "SEQUENCE_DIM", "STATE_PREFIX", "FormatWarning", "Manifest", "StateSpec", "state_io_names",
    "state_key", "canonical_json", "canonical_manifest_equal", "absent", "file_sha256", "join_problems", "normalize_tokenizer",
    "parse_json", "plain_file_name", "positions_feed", "sync_io",
]
