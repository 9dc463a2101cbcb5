"""A manifest cannot lie to the site writer or the JavaScript runtime: each compares what it reads from edgelin.json
with the manifest the graphs carry (as the Python runtime does at load)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from edgelin.errors import ManifestError
from edgelin.runtime.manifest import file_sha256, sync_io
from edgelin.web import write_site
from testkit.exports import copy_of

ROOT = Path(__file__).resolve().parents[2]


def _edit(export_dir: Path, change) -> None:
    path = export_dir / "edgelin.json"
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _mispair(d: dict) -> None:
    """The outputs of the first two states of equal shape swapped (io kept consistent): each present fed back as the
    other's input -- a manifest only the graphs' own copy can tell from the true one."""
    states = d["states"]
    for i, a in enumerate(states):
        for b in states[i + 1:]:
            if a["shape"] == b["shape"] and a["dtype"] == b["dtype"]:
                a["output"], b["output"] = b["output"], a["output"]
                sync_io(d)
                return
    raise AssertionError("no two states of equal shape")


def _other_decode(int8: Path):
    """The decode graph of another export (the int8 one of the same model) put in, its sha256 in edgelin.json."""
    def change(export_dir: Path) -> None:
        (export_dir / "decode.onnx").write_bytes((int8 / "decode.onnx").read_bytes())
        _edit(export_dir, lambda d: d["sha256"].update(decode=file_sha256(export_dir / "decode.onnx")))
    return change


CASES = {
    "states-mispaired": (lambda e: _edit(e, _mispair), "differs from the manifest the graph carries in states"),
    "eos-id-edited": (lambda e: _edit(e, lambda d: d["tokenizer"].update(eos_id=10)), "carries in tokenizer"),
    "context-edited": (lambda e: _edit(e, lambda d: d.update(max_positions=1 << 20)), "carries in max_positions"),
}


@pytest.fixture
def lying(exported, tmp_path):
    def make(case: str) -> Path:
        out = copy_of(exported("elu+1")[1], tmp_path / case)
        if case == "decode-replaced":
            _other_decode(exported("elu+1", options={"precision": "int8"})[1])(out)
        else:
            CASES[case][0](out)
        return out
    return make


NEEDLES = {**{k: v[1] for k, v in CASES.items()}, "decode-replaced": "decode.onnx: edgelin.json differs from the manifest the graph carries in "}


@pytest.mark.parametrize("case", list(NEEDLES))
def test_the_site_writer_refuses_a_manifest_the_graphs_contradict(lying, case, tmp_path):
    export = lying(case)
    with pytest.raises(ManifestError) as err:
        write_site(export, tmp_path / "site", ort_web=tmp_path / "no-ort-needed")
    msg = str(err.value)
    assert NEEDLES[case] in msg and "re-export the model" in msg and "\n" not in msg, msg
    assert case != "decode-replaced" or "precision" in msg
    assert not (tmp_path / "site").exists()


def test_the_cli_says_it_in_one_line(lying, tmp_path):
    from click.testing import CliRunner

    from edgelin.cli import main

    r = CliRunner().invoke(main, ["web", str(lying("states-mispaired")), "-o", str(tmp_path / "site")])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "differs from the manifest the graph carries in states" in r.output


SCRIPT = """
import { readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { join } from "node:path";
const edgelin = await import(process.argv[2]);
const ort = createRequire(join(process.argv[3], "package.json"))(process.argv[3]);
const read = (name) => readFile(join(process.argv[4], name)).then((b) => new Uint8Array(b));
try {
  await edgelin.loadExport(ort, read, { sessionOptions: { executionProviders: ["cpu"], intraOpNumThreads: 1 } });
  console.log("LOADED");
} catch (err) {
  console.log(`${err.name}: ${err.message}`);
}
"""


@pytest.mark.parametrize("case", ["states-mispaired", "eos-id-edited", "decode-replaced", "none"])
def test_the_javascript_runtime_refuses_a_manifest_the_graphs_contradict(node, ort_node, lying, exported, case, tmp_path):
    export = exported("elu+1")[1] if case == "none" else lying(case)
    script = tmp_path / "load.mjs"
    script.write_text(SCRIPT)
    r = subprocess.run([node, str(script), (ROOT / "runtime" / "web" / "edgelin.mjs").as_uri(), str(ort_node), str(export)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout.strip()
    if case == "none":
        assert out == "LOADED", (out, r.stderr[-2000:])
    else:
        assert out.startswith("EdgelinError:") and NEEDLES[case] in out and "re-export the model" in out, (out, r.stderr[-2000:])
        assert case != "decode-replaced" or "precision" in out


def test_the_javascript_check_refuses_another_exports_golden_file(node, ort_node, exported, tmp_path):
    """An int8 export's golden.json in the fp32 export (its hash and size in edgelin.json) would hold the fp32 graphs to the
    int8 budget."""
    export = copy_of(exported("elu+1")[1], tmp_path / "fp32")
    golden = export / "golden.json"
    golden.write_bytes((exported("elu+1", options={"precision": "int8"})[1] / "golden.json").read_bytes())
    _edit(export, lambda d: d["golden"].update(sha256=file_sha256(golden), bytes=golden.stat().st_size))
    script = tmp_path / "check.mjs"
    script.write_text(SCRIPT.replace('console.log("LOADED");', 'await (await edgelin.loadExport(ort, read)).check(); console.log("CHECKED");'))
    r = subprocess.run([node, str(script), (ROOT / "runtime" / "web" / "edgelin.mjs").as_uri(), str(ort_node), str(export)],
                       capture_output=True, text=True, timeout=120)
    assert 'golden.json was made for a "int8" export but edgelin.json says "fp32"' in r.stdout, (r.stdout, r.stderr[-2000:])
