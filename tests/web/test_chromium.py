"""`edgelin web` in a real headless Chromium (Debian's `chromium`): the site, served from 127.0.0.1, generates
the Python runtime's greedy text, and (opened with ``check=1``) checks itself against the export's golden outputs.
The page posts #output, its state and its check to the test's server when opened with ``&report=PATH``. Skipped,
with the reason, where chromium or onnxruntime-web is missing."""

from __future__ import annotations

import json

import pytest

from edgelin.web import open_headless, write_site

PROMPT, N = "The for statement", 48


def open_page(chromium: str, site, query: dict, profile, timeout: float = 240.0) -> dict:
    """Load index.html?query in headless Chromium; the report the page posted ({state, output, ...})."""
    report = open_headless(chromium, site, query, profile, timeout)
    assert report is not None, f"the page reported nothing within {timeout:.0f} s"
    return report


def test_the_site_generates_the_python_runtimes_greedy_text(chromium, ort_web, bundled_export, tmp_path):
    import tempfile
    from pathlib import Path

    from edgelin.runtime import generate_text

    want = generate_text(bundled_export, PROMPT, max_new_tokens=N, provider="cpu", threads=1)["text"]
    site = write_site(bundled_export, tmp_path / "site", ort_web=ort_web).out_dir
    leftovers = lambda: set(Path(tempfile.gettempdir()).glob("org.chromium.Chromium.*"))  # noqa: E731
    before = leftovers()
    report = open_page(chromium, site, {"prompt": PROMPT, "n": N}, tmp_path / "profile")
    # Chromium, killed once the page reported, would leave its own temporary folder in the machine's: it made it in
    # one of edgelin's, removed after it
    assert not leftovers() - before
    assert report["state"] == "done", report["output"]
    assert report["output"] == want
    assert float(report["decodeTokensPerS"]) > 0
    assert report["check"] is None  # checked only when asked (check=1)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_site_checks_itself_against_the_golden_outputs(chromium, ort_web, bundled_exports, precision, tmp_path):
    """?check=1: onnxruntime-web (WASM) runs the export's golden inputs, each group within the logits budget; the
    prompt asked for alongside is still generated, the Python runtime's text."""
    from edgelin.runtime import generate_text
    from edgelin.runtime.golden import check

    export = bundled_exports(precision)
    want = generate_text(export, PROMPT, max_new_tokens=8, provider="cpu", threads=1)["text"]
    python = check(export, ["cpu"], threads=1, timing=False).to_dict()["providers"][0]["results"]
    site = write_site(export, tmp_path / "site", ort_web=ort_web).out_dir
    report = open_page(chromium, site, {"check": "1", "prompt": PROMPT, "n": 8}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    assert report["output"] == want
    got = report["check"]
    assert got["golden"] is True and got["precision"] == precision and got["passed"] is True, got
    assert [x["name"] for x in got["results"]] == [x["name"] for x in python if x["group"] == "golden"]
    for x in got["results"]:
        assert x["passed"] and x["where"] == "" and x["nonfinite"] == 0, x
        assert all(x[k] <= v for k, v in x["budget"].items()), x
        assert 0 <= x["max_rel"] and 0 <= x["rel_l2"], x


def test_a_check_of_wrong_golden_values_fails_in_the_page(chromium, ort_web, bundled_export, tmp_path):
    """A golden value moved by 1.0 (the site's manifest updated to match): the page reports the failed check and
    names the row, and still finishes (state done)."""
    from edgelin.runtime.golden import GOLDEN_FILE, golden_text
    from edgelin.runtime.manifest import MANIFEST_FILE, file_sha256

    site = write_site(bundled_export, tmp_path / "site", ort_web=ort_web).out_dir
    export = site / "export"
    golden = json.loads((export / GOLDEN_FILE).read_text())
    row = next(r for r in golden["rows"] if (r["graph"], r["batch"], r["at"]) == ("prefill", 1, golden["positions"][-1]))
    row["values"][0] -= 1.0
    (export / GOLDEN_FILE).write_text(golden_text(golden), encoding="utf-8")
    manifest = json.loads((export / MANIFEST_FILE).read_text())
    manifest["golden"] = dict(manifest["golden"], sha256=file_sha256(export / GOLDEN_FILE), bytes=(export / GOLDEN_FILE).stat().st_size)
    (export / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    report = open_page(chromium, site, {"check": "1"}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    prefill, decode = report["check"]["results"]
    assert report["check"]["passed"] is False and not prefill["passed"] and decode["passed"], report["check"]
    assert prefill["where"].startswith(f"prefill position {golden['positions'][-1]} of prompt 1:"), prefill["where"]


@pytest.mark.parametrize(("precision", "options"), [("int8", {}), ("int4", {}), ("int8", {"int8_scheme": "block"})],
                         ids=["int8", "int4", "int8-block"])
def test_the_quantised_exports_run_in_the_browser(chromium, ort_web, bundled_exports, precision, options, tmp_path):
    """onnxruntime-web's WASM build runs the quantised table's operators (GatherBlockQuantized, MatMulNBits with 8-bit
    weights) and the int8 / int4 graphs, int8's block scheme too (every MatMul a MatMulNBits with 8-bit weights): the
    page's greedy text is the Python runtime's."""
    from edgelin.runtime import generate_text

    export = bundled_exports(precision, **options)
    want = generate_text(export, PROMPT, max_new_tokens=N, provider="cpu", threads=1)["text"]
    site = write_site(export, tmp_path / "site", ort_web=ort_web).out_dir
    report = open_page(chromium, site, {"prompt": PROMPT, "n": N}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    assert report["output"] == want


def test_a_broken_export_shows_the_error(chromium, ort_web, bundled_export, tmp_path):
    site = write_site(bundled_export, tmp_path / "site", ort_web=ort_web).out_dir
    graph = site / "export" / "decode.onnx"
    data = bytearray(graph.read_bytes())
    data[-1] ^= 1
    graph.write_bytes(bytes(data))
    report = open_page(chromium, site, {"prompt": PROMPT, "n": 4}, tmp_path / "profile")
    assert report["state"] == "error"
    assert "sha256 differs" in report["output"]


def test_a_hybrid_site_generates_the_python_runtimes_text(chromium, ort_web, exported, tmp_path):
    """A hybrid in the browser: layer 1 softmax attention whose KV cache grows to its window of 16 positions, then
    slides (the export tests/web/test_node.py drives in node). The page's greedy text over the prompt and 48 new
    tokens is the Python runtime's."""
    from edgelin.runtime import Manifest, generate_text

    _, out = exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=16)
    assert Manifest.load(out).grows
    want = generate_text(out, PROMPT, max_new_tokens=N, provider="cpu", threads=1)["text"]
    assert want  # something to compare
    site = write_site(out, tmp_path / "site", ort_web=ort_web).out_dir
    report = open_page(chromium, site, {"prompt": PROMPT, "n": N}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    assert report["output"] == want
