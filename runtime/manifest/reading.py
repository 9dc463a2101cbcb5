"""Reading a manifest: ``edgelin/2`` checked against its JSON Schema and then for what a schema cannot say,
``edgelin/1`` read strictly and upgraded in memory, the tokenizer entry normalised and checked, and
``edgelin.json`` loaded from an export folder. The functions take the ``Manifest`` class they build
(``Manifest.from_dict``, ``from_json`` and ``load`` call them). Standard library + numpy only."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from edgelin.errors import ManifestError, RuntimeInputError
from edgelin.runtime.files import check_path, read_regular
from edgelin.runtime.manifest.contract import StateSpec
from edgelin.runtime.manifest.format import (
    DROPPED_V1, FIELDS, FORMAT, FORMAT_V1, GRAPHS, HUGGINGFACE, LOGITS_AT_POSITIONS, LOGITS_DTYPES, MANIFEST_FILE, MAX_DIM,
    MAX_MANIFEST_BYTES, POSITIONS, REQUIRED_V1, TOKEN_INTS, TOKENIZER_OPTIONAL, WEIGHTS,
)
from edgelin.runtime.manifest.strict import json_int, kind_of, name_ok, plain_file_name, short
from edgelin.runtime.schema import json_equal
from edgelin.runtime.schema import validate as validate_schema


class FormatWarning(UserWarning):
    """An export in an older manifest format was read and upgraded in memory."""


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


def check_tokenizer(tok: dict[str, Any], vocab: int, where: str) -> None:
    if tok["kind"] == "bytes":
        if tok["encoding"] != "utf-8":
            raise ManifestError(f"{where}: a 'bytes' tokenizer needs encoding 'utf-8', got {short(tok['encoding'])}")
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


def from_v1(cls: type, d: dict[str, Any], where: str) -> Any:
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
                f"{where}: graphs.{g} is {short(graphs[g])}; a graph must be a plain file name inside the export "
                "folder (no folder, no '..', no absolute path)"
            )
    if graphs["prefill"] == graphs["decode"]:
        raise ManifestError(f"{where}: 'graphs' names one file, {graphs['prefill']!r}, for both graphs; re-export the model")
    for key in ("input_ids", "logits"):
        if not name_ok(d[key]):
            raise ManifestError(f"{where}: {key!r} must be a non-empty name (text), got {short(d[key])}")
    states = d["states"]
    if not isinstance(states, list):
        raise ManifestError(f"{where}: 'states' must be a list, got {kind_of(states)}")
    specs = tuple(StateSpec.from_dict(s, f"{where}: states[{i}]") for i, s in enumerate(states))
    names = [d["input_ids"], d["logits"]] + [s.input for s in specs] + [s.output for s in specs]
    if len(set(names)) != len(names):
        raise ManifestError(f"{where}: input, output and state names are not unique")
    if isinstance(d["vocab_size"], bool) or not isinstance(d["vocab_size"], int) or not 1 <= d["vocab_size"] <= MAX_DIM:
        raise ManifestError(f"{where}: 'vocab_size' must be a positive integer (at most {MAX_DIM:,}), got {short(d['vocab_size'])}")
    if not isinstance(d["tokenizer"], dict) or not isinstance(d["tokenizer"].get("kind"), str):
        raise ManifestError(f"{where}: 'tokenizer' must be an object with a 'kind'")
    tok = dict(d["tokenizer"])
    eos = tok.get("eos_id")
    if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
        raise ManifestError(f"{where}: tokenizer 'eos_id' must be a non-negative integer, got {short(eos)}")
    tok = {k: v for k, v in tok.items() if k in ("kind", "eos_id")}  # edgelin/1 knew no other tokenizer fields
    if not isinstance(d["model"], dict):
        raise ManifestError(f"{where}: 'model' must be an object (the model config), got {kind_of(d['model'])}")
    if isinstance(d["opset"], bool) or not isinstance(d["opset"], int) or not 1 <= d["opset"] <= 1000:
        raise ManifestError(f"{where}: 'opset' must be an integer, got {short(d['opset'])}")
    for key in ("precision", "edgelin_version", "source"):
        if not isinstance(d[key], str):
            raise ManifestError(f"{where}: {key!r} must be text, got {short(d[key])}")
    extra = {k: v for k, v in d.items() if k not in REQUIRED_V1 and k not in DROPPED_V1}
    return cls(
        graphs={g: graphs[g] for g in GRAPHS}, input_ids=d["input_ids"], logits=d["logits"],
        states=specs, vocab_size=d["vocab_size"], tokenizer=tok, model=dict(d["model"]),
        opset=d["opset"], precision=d["precision"], edgelin_version=d["edgelin_version"],
        source=d["source"], extra=extra, read_from=FORMAT_V1,
    )


def manifest_from_dict(cls: type, d: Any, where: str = MANIFEST_FILE, *, embedded: bool = False) -> Any:
    """Read a manifest: edgelin/2 is checked against the schema, then for what a schema cannot say
    (unique names, io equal to what the states imply, init values that fit their dtype); edgelin/1
    is read strictly and upgraded in memory (``read_from`` tells). ``embedded``: the graph-metadata
    copy, which has no ``sha256``."""
    if not isinstance(d, dict):
        raise ManifestError(f"{where} must hold a JSON object, got {kind_of(d)}")
    if d.get("format") == FORMAT_V1:
        return from_v1(cls, d, where)
    if d.get("format") != FORMAT:
        raise ManifestError(
            f"{where} has format {short(d.get('format'))}; this edgelin reads {FORMAT!r} and {FORMAT_V1!r} -- re-export the model with this version"
        )
    from_v1(cls, d, where)  # the fields edgelin/1 had, with the messages it gave; then the schema for all the rest
    hashes_given = "sha256" in d
    checked = d if (hashes_given or not embedded) else {**d, "sha256": {g: "0" * 64 for g in GRAPHS}}
    errors = validate_schema(checked)
    if errors:
        raise ManifestError(f"{where} does not follow the {FORMAT} schema: {'; '.join(errors)} -- re-export the model")
    for g in GRAPHS:  # the schema's file pattern cannot say "not an absolute path" on every system
        if not plain_file_name(d["graphs"][g]):
            raise ManifestError(f"{where}: graphs.{g} is {short(d['graphs'][g])}; a graph must be a plain file name inside the export folder")
    if d["graphs"]["prefill"] == d["graphs"]["decode"]:
        raise ManifestError(f"{where}: 'graphs' names one file, {d['graphs']['prefill']!r}, for both graphs; re-export the model")
    weights = d.get("weights")
    if weights is not None:
        if not plain_file_name(weights["file"]) or weights["file"] in d["graphs"].values() or weights["file"] == MANIFEST_FILE:
            raise ManifestError(f"{where}: weights.file is {short(weights['file'])}; it must be a plain file name inside the export "
                                "folder, other than the graphs and edgelin.json -- re-export the model")
        weights = {"file": weights["file"], "bytes": json_int(weights["bytes"])}
    if hashes_given and (WEIGHTS in d["sha256"]) != (weights is not None):
        raise ManifestError(f"{where}: sha256.weights must be given exactly when 'weights' is; re-export the model")
    states = []
    for i, s in enumerate(d["states"]):
        s = dict(s, shape=[json_int(x) for x in s["shape"]])
        if s["dtype"] == "int64" and isinstance(s["init"], float) and s["init"].is_integer() and abs(s["init"]) < 2**64:
            s["init"] = int(s["init"])
        states.append(StateSpec.from_dict(s, f"{where}: states[{i}]"))
    vocab = json_int(d["vocab_size"])
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
        raise ManifestError(f"{where}: the logits must be one of {', '.join(LOGITS_DTYPES)}, io says {short(logits_dtype)}")
    tok = dict(d["tokenizer"], **{k: json_int(v) for k, v in d["tokenizer"].items() if k in TOKEN_INTS and v is not None})
    if "eos_ids" in tok:
        tok["eos_ids"] = [json_int(i) for i in tok["eos_ids"]]
    check_tokenizer(tok, vocab, where)
    extra = {k: v for k, v in d.items() if k not in FIELDS}
    m = cls(
        graphs=dict(d["graphs"]), input_ids=d["input_ids"], logits=d["logits"], states=tuple(states),
        vocab_size=vocab, tokenizer=tok, model=dict(d["model"]), opset=json_int(d["opset"]),
        precision=d["precision"], edgelin_version=d["edgelin_version"], source=d["source"], extra=extra,
        sha256=dict(d["sha256"]) if hashes_given else None, logits_dtype=logits_dtype,
        min_sequence=json_int(d["min_sequence"]), prefill_piece=json_int(d["prefill_piece"]), lengths=lengths, logits_at=logits_at,
        max_sequence=None if d.get("max_sequence") is None else json_int(d["max_sequence"]),
        max_positions=None if d.get("max_positions") is None else json_int(d["max_positions"]), weights=weights,
    )
    if m.max_sequence is not None and m.max_sequence < m.min_sequence:
        raise ManifestError(f"{where}: max_sequence ({m.max_sequence}) is below min_sequence ({m.min_sequence}); re-export the model")
    for g in GRAPHS:
        if not json_equal(d["io"][g], m.io(g)):
            raise ManifestError(
                f"{where}: io.{g} does not list what input_ids, lengths, logits_at, logits, vocab_size and states imply "
                f"({short(d['io'][g], 80)}); re-export the model"
            )
    return m


def load_manifest(cls: type, export_dir: str | Path) -> Any:
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
            "hashes to check) -- re-export the model to upgrade it", FormatWarning, stacklevel=3,  # Manifest.load's caller
        )
    return m
