"""edgelin.json cannot lie to a runtime: what a runtime reads from it must be what the graphs carry (their embedded
manifest), and golden.json must agree with the manifest it is checked under (precision, budgets)."""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort
import pytest

from edgelin.errors import ManifestError
from edgelin.runtime import golden, load
from edgelin.runtime.manifest import METADATA_KEY, file_sha256
from testkit.exports import copy_of


def _edit(export_dir: Path, change) -> None:
    path = export_dir / "edgelin.json"
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d, indent=2))


@pytest.mark.parametrize(("change", "needle"), [
    (lambda d: d["tokenizer"].update(eos_id=10), "tokenizer eos_id: edgelin.json 10, the graph None"),
    (lambda d: d.update(parity_budgets={"logits": {"max_rel": 1e9, "rel_l2": 1e9}}), "parity_budgets"),
    (lambda d: d.update(prefill_piece=7), "prefill_piece"),
    (lambda d: d.update(max_positions=8), "max_positions"),
], ids=["eos-id", "budgets", "prefill-piece", "max-positions"])
def test_an_edited_field_a_runtime_reads_is_refused_at_load(export_copy, change, needle):
    """A tokenizer id, the budgets check and validate hold the export to, the call bounds and the declared context: the
    Python runtime takes each from edgelin.json, and each must be what the graphs were exported with."""
    _edit(export_copy, change)
    with pytest.raises(ManifestError) as err:
        load(export_copy, provider="cpu")
    msg = str(err.value)
    assert "differs from the manifest the graph carries in" in msg and needle in msg and "re-export the model" in msg, msg
    assert "\n" not in msg


def test_the_graph_manifest_reader_gives_what_onnx_runtime_reads(tiny, tmp_path):
    from edgelin.runtime.check import graph_manifest_text

    for graph in ("prefill.onnx", "decode.onnx"):
        path = tiny[1] / graph
        want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map[METADATA_KEY]
        assert graph_manifest_text(path) == want
    cut = tmp_path / "cut.onnx"
    data = (tiny[1] / "decode.onnx").read_bytes()
    cut.write_bytes(data[: len(data) - 7])
    with pytest.raises(ManifestError, match="not an ONNX file edgelin can read"):
        graph_manifest_text(cut)
    (tmp_path / "none.onnx").write_bytes(b"")
    assert graph_manifest_text(tmp_path / "none.onnx") is None


# ---- golden.json agrees with its manifest ------------------------------------------------------------------
def _put_golden(export_dir: Path, content: bytes) -> None:
    path = export_dir / golden.GOLDEN_FILE
    path.write_bytes(content)
    _edit(export_dir, lambda d: d["golden"].update(sha256=file_sha256(path), bytes=len(content)))


def test_another_exports_golden_file_is_refused(exported, tmp_path):
    """An int8 export's golden.json (its hash and size put in the fp32 export's edgelin.json) would hold the fp32 graphs
    to the int8 budget."""
    fp32 = copy_of(exported("elu+1")[1], tmp_path / "fp32")
    int8 = exported("elu+1", options={"precision": "int8"})[1]
    _put_golden(fp32, (int8 / golden.GOLDEN_FILE).read_bytes())
    with pytest.raises(ManifestError, match="golden.json was made for a 'int8' export but edgelin.json says 'fp32'"):
        golden.check(fp32, ["cpu"], timing=False)


@pytest.mark.parametrize("kind", ["logits", "provider"])
def test_golden_budgets_looser_than_the_manifests_are_refused(export_copy, kind):
    d = json.loads((export_copy / golden.GOLDEN_FILE).read_text())
    d["budgets"][kind] = {k: 1e9 for k in d["budgets"][kind]}
    _put_golden(export_copy, golden.golden_text(d).encode())
    with pytest.raises(ManifestError, match=f"holds the export to {kind} .* <= 1e\\+09, looser than the .* re-export the model"):
        golden.check(export_copy, ["cpu"], timing=False)


def test_a_golden_bound_left_out_is_refused(export_copy):
    d = json.loads((export_copy / golden.GOLDEN_FILE).read_text())
    del d["budgets"]["logits"]["max_rel"]
    _put_golden(export_copy, golden.golden_text(d).encode())
    with pytest.raises(ManifestError, match="logits max_rel <= inf, looser"):
        golden.check(export_copy, ["cpu"], timing=False)


def test_an_exports_own_golden_file_agrees(tiny):
    report = golden.check(tiny[1], ["cpu"], timing=False)
    assert report.golden and report.passed
