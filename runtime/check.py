"""The manifest <-> graph structure check: does a graph have exactly the inputs and outputs, dtypes and
shapes its manifest promises, for its role? Used by ``Session`` at load and by ``edgelin validate``.

Reads the graph through an ONNX Runtime session (no onnx package needed on a device).
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from edgelin.errors import ManifestError
from edgelin.runtime.manifest import METADATA_KEY, SEQUENCE_DIM, Manifest

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


def _wiring_problems(file: str, own: Manifest, m: Manifest) -> list[str]:
    differ = [k for k in WIRING if getattr(own, k) != getattr(m, k)]
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
    return [f"{file}: edgelin.json differs from the manifest the graph carries in {', '.join(differ)}{detail}; "
            "edgelin.json was edited or comes from another export -- re-export the model"]


__all__ = ["check_graph", "graph_io", "graph_role"]
