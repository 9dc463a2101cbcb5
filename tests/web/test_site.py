"""`edgelin web` without a browser: what the site holds, output-folder safety, one-line errors."""

from __future__ import annotations

import json
import shutil
import urllib.request

import pytest
from click.testing import CliRunner

from edgelin.cli import main
from edgelin.errors import ManifestError, OutputError, RuntimeInputError
from edgelin.runtime.manifest import file_sha256
from edgelin.web import find_ort_web, serve_in_thread, site_files, write_site


@pytest.fixture
def tiny_export(exported):
    return exported("elu+1")[1]


def test_the_site_holds_page_module_export_and_ort(tiny_export, ort_web, tmp_path):
    r = write_site(tiny_export, tmp_path / "site", ort_web=ort_web)
    names = set(r.files)
    assert {"index.html", "edgelin.mjs", "export/edgelin.json", "export/prefill.onnx", "export/decode.onnx", "export/weights.data",
            "export/golden.json", "ort/ort.wasm.min.mjs", "ort/ort-wasm-simd-threaded.wasm", "ort/ort-wasm-simd-threaded.mjs"} == names
    assert site_files(r.out_dir) is not None
    m = json.loads((r.out_dir / "export" / "edgelin.json").read_text())
    assert m["format"] == "edgelin/2" and not r.upgraded
    # the golden outputs travel with the export, unchanged: the page's ?check=1 reads them
    assert (r.out_dir / "export" / "golden.json").read_bytes() == (tiny_export / "golden.json").read_bytes()
    assert m["golden"] == json.loads((tiny_export / "edgelin.json").read_text())["golden"]
    assert m["golden"]["sha256"] == file_sha256(r.out_dir / "export" / "golden.json")
    assert "check=1" in r.summary()
    server, base = serve_in_thread(r.out_dir)
    try:
        with urllib.request.urlopen(base + "ort/ort-wasm-simd-threaded.wasm") as resp:
            assert resp.headers["Content-Type"] == "application/wasm"
        with urllib.request.urlopen(base + "edgelin.mjs") as resp:
            assert resp.headers["Content-Type"].startswith("text/javascript")
    finally:
        server.shutdown()
        server.server_close()


def test_force_replaces_only_a_site_edgelin_wrote(tiny_export, ort_web, tmp_path):
    out = tmp_path / "site"
    write_site(tiny_export, out, ort_web=ort_web)
    with pytest.raises(OutputError, match="already exists"):
        write_site(tiny_export, out, ort_web=ort_web)
    write_site(tiny_export, out, ort_web=ort_web, force=True)
    (out / "notes.txt").write_text("mine")  # the user's file: no longer a site edgelin wrote
    with pytest.raises(OutputError, match="not a site written by edgelin web"):
        write_site(tiny_export, out, ort_web=ort_web, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "index.html").write_text("someone's page")
    with pytest.raises(OutputError, match="not a site written by edgelin web"):
        write_site(tiny_export, other, ort_web=ort_web, force=True)
    assert (other / "index.html").read_text() == "someone's page"
    with pytest.raises(OutputError, match="inside the export"):
        write_site(tiny_export, tiny_export / "site", ort_web=ort_web)


def test_a_tampered_export_is_refused(tiny_export, ort_web, tmp_path):
    copy = tmp_path / "export"
    shutil.copytree(tiny_export, copy)
    data = bytearray((copy / "decode.onnx").read_bytes())
    data[-1] ^= 1
    (copy / "decode.onnx").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="sha256 differs"):
        write_site(copy, tmp_path / "site", ort_web=ort_web)
    assert not (tmp_path / "site").exists()


def test_an_export_with_a_missing_or_changed_golden_file_is_refused(tiny_export, ort_web, tmp_path):
    copy = tmp_path / "export"
    shutil.copytree(tiny_export, copy)
    data = bytearray((copy / "golden.json").read_bytes())
    data[-2] = ord(" ")  # the closing brace: the same size, another sha256
    (copy / "golden.json").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="golden.json is not the file edgelin.json records"):
        write_site(copy, tmp_path / "site", ort_web=ort_web)
    (copy / "golden.json").unlink()
    with pytest.raises(ManifestError, match="lacks golden.json"):
        write_site(copy, tmp_path / "site", ort_web=ort_web)
    assert not (tmp_path / "site").exists()


def test_an_export_without_golden_outputs_makes_a_site_without_them(tiny_export, ort_web, tmp_path):
    """An export made before golden outputs (no 'golden' in its manifest) still makes a site, without golden.json."""
    copy = tmp_path / "export"
    shutil.copytree(tiny_export, copy)
    (copy / "golden.json").unlink()
    manifest = json.loads((copy / "edgelin.json").read_text())
    del manifest["golden"]
    (copy / "edgelin.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    r = write_site(copy, tmp_path / "site", ort_web=ort_web)
    assert "export/golden.json" not in r.files and "export/edgelin.json" in r.files
    assert "golden" not in json.loads((r.out_dir / "export" / "edgelin.json").read_text())
    assert "check=1" not in r.summary()


def test_missing_onnxruntime_web_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("EDGELIN_ORT_WEB", raising=False)
    with pytest.raises(RuntimeInputError, match="npm install onnxruntime-web"):
        find_ort_web(tmp_path / "nothing")


def test_cli_errors_are_one_line(tiny_export, tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["web", str(tiny_export)])
    assert r.exit_code == 2 and "name the site folder with -o" in r.output
    r = runner.invoke(main, ["web", str(tiny_export), "-o", str(tmp_path / "s"), "--ort-web", str(tmp_path / "none")])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "edgelin: error: onnxruntime-web is not installed" in r.output


def test_an_ids_only_export_is_said_at_build(tiny_export, exported, ort_web, tmp_path):
    """An export without a text tokenizer (kind 'ids': a model of 1,024 ids) makes a site, and the build says the page
    works in token ids and how to get text; a byte-tokenizer export's summary says nothing of the kind."""
    _, ids_only = exported("elu+1", options={"precision": "fp32"}, vocab_size=1024)  # test_node's tied-head export
    from edgelin.runtime.manifest import Manifest

    assert Manifest.load(ids_only).tokenizer["kind"] == "ids"
    summary = write_site(ids_only, tmp_path / "site", ort_web=ort_web).summary()
    assert "no text tokenizer (tokenizer kind 'ids')" in summary and "--tokenizer" in summary
    assert "no text tokenizer" not in write_site(tiny_export, tmp_path / "site2", ort_web=ort_web).summary()


# id -> (precision, export options, whether the graphs must hold MatMulNBits; None: whatever the graphs say)
WASM_CASES = {"fp32": ("fp32", {}, False), "int4": ("int4", {}, True), "int8-block": ("int8", {"int8_scheme": "block"}, True),
              "int8": ("int8", {}, None), "int8-channel-fp32-table": ("int8", {"embedding": "fp32"}, False)}


@pytest.mark.parametrize("case", list(WASM_CASES))
def test_the_summary_says_when_the_wasm_backend_widens_block_quantised_weights(case, bundled_exports, ort_web, tmp_path):
    """The note appears exactly when a graph holds a MatMulNBits node (counted by the ONNX package here)."""
    import onnx

    precision, options, expected = WASM_CASES[case]
    export_dir = bundled_exports(precision, **options)
    counted = sum(n.op_type == "MatMulNBits" for g in ("prefill.onnx", "decode.onnx")
                  for n in onnx.load(export_dir / g, load_external_data=False).graph.node)
    if expected is not None:
        assert (counted > 0) == expected, counted
    r = write_site(export_dir, tmp_path / "site", ort_web=ort_web)
    assert r.wasm_slow == (counted > 0)
    assert ("MatMulNBits nodes (block-quantised weights)" in r.summary()) == (counted > 0)


def test_holds_op_reads_the_node_type_only_and_across_its_read_pieces(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from edgelin.web import holds_op

    def model(op_type, name):
        node = helper.make_node(op_type, ["x"], ["y"], name=name)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        path = tmp_path / f"{op_type}-{name}.onnx"
        onnx.save(helper.make_model(graph, ir_version=10), path)
        return path

    named = model("Identity", "MatMulNBits")  # the name, not the type
    typed = model("MatMulNBits", "n")
    assert not holds_op(named, b"MatMulNBits") and holds_op(typed, b"MatMulNBits")
    data = typed.read_bytes()
    at = data.index(b"MatMulNBits")
    for chunk in (1, 2, 7, at, at + 1, at + 5, len(data)):  # the type cut at every kind of place between two reads
        assert holds_op(typed, b"MatMulNBits", chunk=chunk), chunk
        assert not holds_op(named, b"MatMulNBits", chunk=chunk), chunk
