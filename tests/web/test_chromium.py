"""`edgelin web` in a real headless Chromium (Debian's `chromium`): the site, served from 127.0.0.1, generates
the Python runtime's greedy text. The page posts #output and its state to the test's server when opened
with ``&report=PATH``. Skipped, with the reason, where chromium or onnxruntime-web is missing."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse

import pytest

from edgelin.web import _Handler, serve_in_thread, write_site

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
PROMPT, N = "The for statement", 48


def open_page(chromium: str, site, query: dict, profile, timeout: float = 240.0) -> dict:
    """Load index.html?query in headless Chromium; the report the page posted ({state, output, ...})."""
    got: dict = {}

    class Handler(_Handler):
        def do_POST(self):
            size = int(self.headers.get("Content-Length", 0))
            got["report"] = json.loads(self.rfile.read(size))
            self.send_response(204)
            self.end_headers()

    server, base = serve_in_thread(site, 0, Handler)
    url = base + "index.html?" + urllib.parse.urlencode({**query, "report": "/__report"})
    proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        start = time.monotonic()
        while "report" not in got and proc.poll() is None and time.monotonic() - start < timeout:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
        server.shutdown()
        server.server_close()
    assert "report" in got, f"the page reported nothing within {timeout:.0f} s (chromium exit {proc.returncode})"
    return got["report"]


def test_the_site_generates_the_python_runtimes_greedy_text(chromium, ort_web, bundled_export, tmp_path):
    from edgelin.runtime import generate_text

    want = generate_text(bundled_export, PROMPT, max_new_tokens=N, provider="cpu", threads=1)["text"]
    site = write_site(bundled_export, tmp_path / "site", ort_web=ort_web).out_dir
    report = open_page(chromium, site, {"prompt": PROMPT, "n": N}, tmp_path / "profile")
    assert report["state"] == "done", report["output"]
    assert report["output"] == want
    assert float(report["decodeTokensPerS"]) > 0


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_the_quantised_exports_run_in_the_browser(chromium, ort_web, bundled_exports, precision, tmp_path):
    """onnxruntime-web's WASM build runs the quantised table's operators (GatherBlockQuantized, MatMulNBits with 8-bit
    weights) and the int8 / int4 graphs: the page's greedy text is the Python runtime's."""
    from edgelin.runtime import generate_text

    export = bundled_exports(precision)
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
