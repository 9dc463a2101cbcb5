"""The manifest <-> graph structure check: does a graph have exactly the inputs and outputs, dtypes and
shapes its manifest promises, for its role? Used by ``Session`` at load and by ``edgelin validate``.

Reads the graph through an ONNX Runtime session (no onnx package needed on a device).
"""

from __future__ import annotations

import os
from typing import Any

import onnxruntime as ort

from edgelin.errors import ManifestError
from edgelin.runtime.manifest import FORMAT_V1, METADATA_KEY, SEQUENCE_DIM, Manifest

ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)"}
SEQUENCE = SEQUENCE_DIM  # the token dim of input_ids and logits, per graph role


def graph_io(sess: ort.InferenceSession, outputs: bool) -> dict[str, Any]:
    return {a.name: a for a in (sess.get_outputs() if outputs else sess.get_inputs())}


def graph_role(sess: ort.InferenceSession, m: Manifest) -> str | None:
    """"prefill" or "decode", as the graph itself says: its name (``edgelin_prefill`` / ``edgelin_decode``),
    else its input_ids (a fixed length of 1 is the decode graph's); None if it says neither."""
    name = sess.get_modelmeta().graph_name
    for role in SEQUENCE:
        if name == f"edgelin_{role}":
            return role
    ids = graph_io(sess, False).get(m.input_ids)
    if ids is not None and len(ids.shape) == 2:
        return "decode" if ids.shape[1] == 1 else "prefill" if isinstance(ids.shape[1], str) else None
    return None


def _dims_problem(have: list, want: list) -> bool:
    """A manifest int must be that int; a manifest symbol must not be a fixed size."""
    if len(have) != len(want):
        return True
    return any((isinstance(w, int) and h != w) or (isinstance(w, str) and isinstance(h, int)) for h, w in zip(have, want))


def check_graph(role: str, file: str, sess: ort.InferenceSession, m: Manifest, *, metadata: str = "source") -> list[str]:
    """Every problem between the ``role`` graph ("prefill" or "decode") and the manifest: names, dtypes,
    shapes (input_ids and logits per role, so swapped graphs are named), extra inputs, and the manifest
    embedded in the graph's metadata — ``metadata="source"``: from the same model; ``"content"``: the same
    manifest (compared as parsed JSON, so formatting does not matter); ``"ignore"``."""
    io = m.io(role)  # every input and output the manifest lists for this graph
    want_in = {t["name"]: (t["dtype"], t["shape"]) for t in io["inputs"]}
    want_out = {t["name"]: (t["dtype"], t["shape"]) for t in io["outputs"]}
    role_found = graph_role(sess, m)
    if role_found is not None and role_found != role:
        return [f"{file} is the {role_found} graph but edgelin.json names it as the {role} graph (were the files swapped or renamed?)"]
    problems = []
    have_in = graph_io(sess, False)
    for kind, want, have in (("input", want_in, have_in), ("output", want_out, graph_io(sess, True))):
        for name, (dtype, shape) in want.items():
            arg = have.get(name)
            if arg is None:
                problems.append(f"{file} has no {kind} {name!r}")
                continue
            if arg.type != ORT_TYPES[dtype]:
                problems.append(f"{file} {kind} {name!r} is {arg.type}, the manifest says {dtype}")
            elif len(arg.shape) != len(shape):
                problems.append(f"{file} {kind} {name!r} has rank {len(arg.shape)}, the manifest says {len(shape)}")
            elif _dims_problem(list(arg.shape), shape):
                problems.append(f"{file} {kind} {name!r} has shape {list(arg.shape)}, the manifest says {shape}")
        if kind == "input":
            problems += [f"{file} has input {n!r} that the manifest does not name" for n in have if n not in want]
    if metadata != "ignore":
        problems += _metadata_problems(file, sess, m, metadata)
    return problems


def _metadata_problems(file: str, sess: ort.InferenceSession, m: Manifest, how: str) -> list[str]:
    meta = sess.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
    return embedded_problems(file, meta, m, how)


def embedded_problems(file: str, meta: str | None, m: Manifest, how: str = "source") -> list[str]:
    """Every problem between ``m`` (edgelin.json) and ``meta``, the manifest text the graph ``file`` carries (None:
    none): ``how`` "source": the same model, and everything a runtime reads from edgelin.json as the graph says it
    (``runtime_differences``); "content": the same manifest, every field."""
    if meta is None:
        return [f"{file} has no '{METADATA_KEY}' metadata"] if how == "content" else []
    try:
        own = Manifest.from_json(meta, f"{file} metadata", embedded=True)
    except ManifestError as exc:
        return [str(exc)]
    if how == "content":
        mine, theirs = own.to_dict(embedded=True), m.to_dict(embedded=True)  # a graph cannot hold its own hash
        differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if differ:  # compared as parsed JSON: formatting and key order do not matter
            return [f"{file}: its '{METADATA_KEY}' metadata differs from edgelin.json in {', '.join(differ)} (graph and manifest come from different exports)"]
    elif own.source != m.source or own.model != m.model:
        return [f"{file} was exported from another model than edgelin.json describes (files from two exports?)"]
    else:
        return _wiring_problems(file, own, m)
    return []


# What a runtime wires and feeds by the manifest: it must be what the graph itself was exported with. An
# edgelin.json whose states are paired differently (present.0.S fed back as state.1.S, of equal shape), with
# another init, precision or logits name would run and give garbage; the graph's embedded copy tells.
WIRING = ("input_ids", "logits", "lengths", "logits_at", "vocab_size", "precision", "logits_dtype", "min_sequence", "states")
# Not compared: ``sha256`` (a file cannot hold its own hash), and the entries that name files by their sha256, which
# each runtime checks against the files themselves: ``golden`` (golden.json must also agree with the manifest:
# golden.Golden.load) and the tokenizer's ``files`` (tokenizer.json, a chat template in tokenizer_config.json).
UNCOMPARED = ("sha256", "golden")
TOKENIZER_UNCOMPARED = ("files",)


def runtime_differences(own: Manifest, m: Manifest) -> list[str]:
    """The fields in which edgelin.json (``m``) differs from the manifest a graph carries (``own``), of those a runtime
    reads: every field but ``UNCOMPARED`` (the tokenizer less its file hashes) -- the wiring, the tokenizer's ids (an
    eos id edited stops generation early), the declared context and call bounds, the budgets ``check`` and ``validate``
    hold the export to. An edgelin/1 manifest is compared in the fields that format has."""
    if FORMAT_V1 in (own.read_from, m.read_from):
        fields = [k for k in WIRING if getattr(own, k) != getattr(m, k)]
        return fields + (["tokenizer"] if _tokenizer(own.tokenizer) != _tokenizer(m.tokenizer) else [])
    mine, theirs = own.to_dict(embedded=True), m.to_dict(embedded=True)
    for d in (mine, theirs):
        d["tokenizer"] = _tokenizer(d["tokenizer"])
    keys = list(theirs) + [k for k in mine if k not in theirs]
    differ = [k for k in keys if k not in UNCOMPARED and mine.get(k) != theirs.get(k)]
    derived = [k for k in ("io", "symbols") if k in differ]  # what other fields imply: named after them
    return sorted((k for k in differ if k not in derived), key=lambda k: k != "states") + derived


def _tokenizer(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k not in TOKENIZER_UNCOMPARED}


def _wiring_problems(file: str, own: Manifest, m: Manifest) -> list[str]:
    differ = runtime_differences(own, m)
    if not differ:
        return []
    detail = ""
    if "states" in differ:
        theirs = {s.input: s for s in own.states}
        for s in m.states:
            g = theirs.get(s.input)
            if g != s:
                detail = (f" (edgelin.json: {s.input} <- {s.output} {s.dtype}{list(s.shape)} init {s.init}; the graph: "
                          + (f"{g.input} <- {g.output} {g.dtype}{list(g.shape)} init {g.init})" if g is not None else "no such state)"))
                break
    elif "tokenizer" in differ:
        mine, theirs = _tokenizer(m.tokenizer), _tokenizer(own.tokenizer)
        key = next(k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k))
        detail = f" (tokenizer {key}: edgelin.json {mine.get(key)!r}, the graph {theirs.get(key)!r})"
    return [f"{file}: edgelin.json differs from the manifest the graph carries in {', '.join(differ)}{detail}; "
            "edgelin.json was edited or comes from another export -- re-export the model"]


# ---- the manifest a graph file carries, read without ONNX Runtime or the onnx package -----------------------
# ModelProto.metadata_props is field 14, each entry a StringStringEntryProto (key: field 1, value: field 2). The
# file's top-level fields are walked, each skipped by its length (the graph itself, field 7, is not read).
_METADATA_FIELD, _MAX_METADATA = 14, 64 << 20


def graph_manifest_text(path: str | os.PathLike) -> str | None:
    """The manifest text ``path`` (an ONNX file) carries in its metadata under ``METADATA_KEY``; None where it has
    none. ManifestError for a file that is not a readable ONNX protobuf."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            while f.tell() < size:
                tag = _varint(f)
                number, wire = tag >> 3, tag & 7
                if wire == 0:
                    _varint(f)
                elif wire in (1, 5):
                    f.seek(8 if wire == 1 else 4, os.SEEK_CUR)
                elif wire == 2:
                    n = _varint(f)
                    if f.tell() + n > size:
                        raise ValueError("a field runs past the end of the file")
                    if number != _METADATA_FIELD or n > _MAX_METADATA:
                        f.seek(n, os.SEEK_CUR)
                        continue
                    entry = _fields(f.read(n))
                    if entry.get(1) == METADATA_KEY.encode():
                        return entry.get(2, b"").decode("utf-8")
                else:
                    raise ValueError(f"protobuf wire type {wire}")
                if f.tell() > size:
                    raise ValueError("a field runs past the end of the file")
    except OSError as exc:
        raise ManifestError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path} is not an ONNX file edgelin can read ({exc}); re-export the model") from None
    return None


def _varint(f) -> int:
    value = 0
    for shift in range(0, 70, 7):
        b = f.read(1)
        if not b:
            raise ValueError("the file ends inside a field")
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
    raise ValueError("a varint longer than 10 bytes")


def _fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of one small message (a metadata entry: key 1, value 2)."""
    import io

    f, out = io.BytesIO(data), {}
    while f.tell() < len(data):
        tag = _varint(f)
        if tag & 7 != 2:
            raise ValueError("a metadata entry with a field that is not a string")
        n = _varint(f)
        out[tag >> 3] = f.read(n)
        if len(out[tag >> 3]) != n:
            raise ValueError("a metadata entry runs past its end")
    return out


__all__ = ["check_graph", "embedded_problems", "graph_io", "graph_manifest_text", "graph_role", "runtime_differences"]
