"""The manifest's JSON Schema (runtime/schema/edgelin-2.schema.json), the small validator that checks it on
write and read, and the Python reader: the same good and bad manifests go through all three, and the
reference implementation of JSON Schema (the ``jsonschema`` package) where it is installed."""

from __future__ import annotations

import copy
import json
import warnings

import pytest

from edgelin.errors import ManifestError
from edgelin.runtime.manifest import FORMAT_V1, FormatWarning, Manifest, sync_io
from edgelin.runtime.schema import SCHEMA_FILE, schema, validate


def _set(path, value):
    def edit(d):
        *head, last = path
        for k in head:
            d = d[k]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return edit


_DELETE = object()


def _every_position(d):
    """The manifest of the same export made with --all-logits: no logits_at, layout "every", no "positions" symbol."""
    del d["logits_at"], d["symbols"]["positions"]
    d["logits_layout"]["positions"] = "every"
    sync_io(d)

# bad manifests the schema itself refuses: (id, edit)
SCHEMA_BAD = [
    ("no-format", _set(["format"], _DELETE)),
    ("format-3", _set(["format"], "edgelin/3")),
    ("graphs-extra", _set(["graphs", "third"], "x.onnx")),
    ("graph-in-folder", _set(["graphs", "prefill"], "a/prefill.onnx")),
    ("graph-dotdot", _set(["graphs", "decode"], "..")),
    ("no-sha256", _set(["sha256"], _DELETE)),
    ("sha256-upper", _set(["sha256", "prefill"], "A" * 64)),
    ("sha256-short", _set(["sha256", "decode"], "0" * 63)),
    ("sha256-newline", _set(["sha256", "decode"], "0" * 64 + "\n")),
    ("symbols-extra", _set(["symbols", "time"], "?")),
    ("io-missing-decode", _set(["io", "decode"], _DELETE)),
    ("io-dtype", _set(["io", "prefill", "inputs", 0, "dtype"], "int32")),
    ("io-dim-zero", _set(["io", "decode", "inputs", 0, "shape", 1], 0)),
    ("io-dim-symbol", _set(["io", "decode", "inputs", 0, "shape", 0], "tokens")),
    ("io-empty-outputs", _set(["io", "decode", "outputs"], [])),
    ("layout-next", _set(["logits_layout", "next_token"], "first")),
    ("layout-axes", _set(["logits_layout", "axes"], ["sequence", "batch", "vocab"])),
    ("layout-positions", _set(["logits_layout", "positions"], "last")),
    ("logits-at-empty", _set(["logits_at"], "")),
    ("io-dim-positions-typo", _set(["io", "prefill", "inputs", 1, "shape", 1], "position")),
    ("min-seq-0", _set(["min_sequence"], 0)),
    ("piece-text", _set(["prefill_piece"], "1024")),
    ("piece-bool", _set(["prefill_piece"], True)),
    ("piece-fraction", _set(["prefill_piece"], 10.5)),
    ("max-seq-0", _set(["max_sequence"], 0)),
    ("max-seq-text", _set(["max_sequence"], "4096")),
    ("state-dtype", _set(["states", 0, "dtype"], "float64")),
    ("state-init-text", _set(["states", 0, "init"], "0")),
    ("state-extra", _set(["states", 0, "note"], 1)),
    ("vocab-0", _set(["vocab_size"], 0)),
    ("vocab-huge", _set(["vocab_size"], 2**40)),
    ("tokenizer-short", _set(["tokenizer"], {"kind": "bytes"})),
    ("tokenizer-encoding", _set(["tokenizer", "encoding"], "latin-1")),
    ("tokenizer-eos-negative", _set(["tokenizer", "eos_id"], -1)),
    ("tokenizer-kind-empty", _set(["tokenizer", "kind"], "")),
    ("model-list", _set(["model"], [])),
    ("opset-0", _set(["opset"], 0)),
    ("source-number", _set(["source"], 5)),
    ("chunk-0", _set(["chunk_size"], 0)),
]

# bad manifests only the reader refuses (what a schema cannot say): (id, edit, message)
READER_BAD = [
    ("same-file", _set(["graphs", "decode"], "prefill.onnx"), "one file"),
    ("io-vs-states", _set(["io", "prefill", "inputs", 1, "shape", 1], 99), "does not list what"),
    ("io-order", lambda d: d["io"]["decode"]["inputs"].reverse(), "does not list what"),
    ("logits-int", _set(["io", "prefill", "outputs", 0, "dtype"], "int64"), "the logits must be"),
    ("names-not-unique", _set(["logits"], "input_ids"), "not unique"),
    ("state-symbol", _set(["states", 0, "shape", 1], "sequence"), "only the batch dim"),
    ("eos-outside", _set(["tokenizer", "eos_id"], 4096), "outside the vocabulary"),
    ("integer-as-float", _set(["vocab_size"], 256.0), "must be a positive integer"),  # JSON Schema counts 256.0 an integer
    ("bytes-offset", _set(["tokenizer", "offset"], 1), "needs a vocabulary of 257"),
    ("max-below-min", lambda d: d.update(min_sequence=8, max_sequence=4), r"max_sequence \(4\) is below min_sequence \(8\)"),
    ("logits-at-layout-every", _set(["logits_layout", "positions"], "every"), "exactly when"),
    ("logits-at-no-symbol", _set(["symbols", "positions"], _DELETE), "exactly when"),
    ("logits-at-dropped", _set(["logits_at"], _DELETE), "exactly when"),
    ("logits-at-name-clash", _set(["logits_at"], "input_ids"), "not unique"),
    ("logits-at-renamed", _set(["logits_at"], "picks"), "does not list what"),
]


@pytest.fixture(scope="module")
def good(exported):
    return [json.loads((exported(fm)[1] / "edgelin.json").read_text()) for fm in ("elu+1", "cosformer")]


def _jsonschema_errors(d):
    jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package is not installed (pip install '.[test]')")
    return list(jsonschema.Draft202012Validator(schema()).iter_errors(d))


def test_the_schema_is_valid_draft_2020_12():
    jsonschema = pytest.importorskip("jsonschema", reason="the jsonschema package is not installed (pip install '.[test]')")
    jsonschema.Draft202012Validator.check_schema(schema())
    assert schema()["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert SCHEMA_FILE.name == "edgelin-2.schema.json"


def test_exports_follow_the_schema(good):
    for d in good:
        assert validate(d) == []
        assert _jsonschema_errors(d) == []
        m = Manifest.from_dict(d)
        assert json.loads(m.to_json()) == d  # read and written back unchanged


def test_a_bound_on_prefill_calls_is_read_and_written_back(good):
    """max_sequence (a delta-rule export's bound on tokens per prefill call) is optional: absent where the graph
    takes any length, read and written back where given."""
    assert all("max_sequence" not in d for d in good) and all(Manifest.from_dict(d).max_sequence is None for d in good)
    d = dict(copy.deepcopy(good[0]), max_sequence=4096)
    assert validate(d) == [] and Manifest.from_dict(d).max_sequence == 4096
    assert json.loads(Manifest.from_dict(d).to_json()) == d


@pytest.mark.parametrize("edit", [pytest.param(e, id=i) for i, e in SCHEMA_BAD])
def test_schema_and_reader_refuse_the_same_bad_manifests(good, edit):
    d = copy.deepcopy(good[0])
    edit(d)
    assert validate(d), "the small validator accepted it"
    assert _jsonschema_errors(d), "jsonschema accepted it"
    with pytest.raises(ManifestError):  # the edgelin/1 fields keep their messages; the rest name the schema
        Manifest.from_dict(d)


@pytest.mark.parametrize("edit, message", [pytest.param(e, m, id=i) for i, e, m in READER_BAD])
def test_what_only_the_reader_refuses(good, edit, message):
    d = copy.deepcopy(good[0])
    edit(d)
    assert validate(d) == [] and _jsonschema_errors(d) == []  # valid JSON Schema-wise ...
    with pytest.raises(ManifestError, match=message):  # ... but not a manifest a runtime can follow
        Manifest.from_dict(d)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(_set(["extension"], {"any": ["thing"]}), id="unknown-top-level-field"),
        pytest.param(_set(["tokenizer", "eos_id"], 10), id="eos"),
        pytest.param(_every_position, id="every-position-logits"),  # an export made before logits_at, or --all-logits
        pytest.param(lambda d: (_set(["logits_at"], "picks")(d), sync_io(d)), id="logits-at-named-otherwise"),
    ],
)
def test_schema_and_reader_accept_the_same_variants(good, edit):
    d = copy.deepcopy(good[0])
    edit(d)
    assert validate(d) == [] and _jsonschema_errors(d) == []
    m = Manifest.from_dict(d)
    assert isinstance(m.vocab_size, int)


def test_the_embedded_copy_has_no_hashes(good):
    d = copy.deepcopy(good[0])
    d.pop("sha256")
    with pytest.raises(ManifestError, match="sha256"):
        Manifest.from_dict(d)
    m = Manifest.from_dict(d, embedded=True)
    assert m.sha256 is None and "sha256" not in m.to_dict(embedded=True)
    with pytest.raises(ManifestError, match="no graph hashes"):
        m.to_json()


def test_an_edgelin_1_export_loads_upgraded_with_a_warning(exported, tmp_path):
    import shutil

    from edgelin.runtime import load

    src = exported("elu+1", options={"logits_at": False})[1]  # graphs as every export had before logits_at
    old = tmp_path / "old"
    shutil.copytree(src, old)
    d = json.loads((old / "edgelin.json").read_text())
    v1 = {k: d[k] for k in ("graphs", "input_ids", "logits", "states", "vocab_size", "model", "opset", "precision", "edgelin_version", "source", "chunk_size")}
    v1 |= {"format": FORMAT_V1, "tokenizer": {"kind": "bytes"}, "weights_file": "model.safetensors"}
    (old / "edgelin.json").write_text(json.dumps(v1))
    with pytest.warns(FormatWarning, match="older format edgelin/1"):
        m = Manifest.load(old)
    assert m.read_from == FORMAT_V1 and m.sha256 is None and "weights_file" not in m.extra
    assert m.tokenizer == {"kind": "bytes", "encoding": "utf-8", "offset": 0, "bos_id": None, "eos_id": None, "pad_id": None}
    assert m.io("decode") == Manifest.load(src).io("decode")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FormatWarning)
        s_old, s_new = load(old, provider="cpu"), load(src, provider="cpu")
    ids = [[1, 2, 3, 250]]
    a, b = s_old.prefill(ids, s_old.new_state()), s_new.prefill(ids, s_new.new_state())
    assert (a == b).all()


def test_file_problems_say_re_export_once():
    from edgelin.runtime.manifest import join_problems

    both = ["prefill.onnx is not the file (...); re-export the model", "decode.onnx is not the file (...); re-export the model"]
    assert join_problems(both) == "prefill.onnx is not the file (...); decode.onnx is not the file (...); re-export the model"
    assert join_problems(["x is the decode graph (were the files swapped or renamed?)"]) == "x is the decode graph (were the files swapped or renamed?)"
