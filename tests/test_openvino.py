"""A second execution provider measured here: a fresh venv with ``onnxruntime-openvino`` (which cannot share an
environment with onnxruntime-gpu), the edgelin wheel and numpy/click/tokenizers only runs ``edgelin check
--providers cpu,openvino`` -- each provider against the golden outputs, OpenVINO against the CPU provider -- on
the bundled export and on a hybrid export (decayed linear attention + a softmax-attention layer with a KV
cache). Builds a wheel and a venv (about a minute; needs the package index), so it is marked ``slow``."""

from __future__ import annotations

import json

import pytest

from testkit.venvs import device_venv, run

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("openvino")]  # one venv, on one worker

HYBRID = {"decay": "scalar", "attn_layers": (1,), "attn_window": 16}  # the shared hybrid export (tests/web too)


@pytest.fixture(scope="module")
def openvino_venv(tmp_path_factory):
    return device_venv(tmp_path_factory.mktemp("openvino"), "onnxruntime-openvino")


@pytest.mark.parametrize("which", ["bundled", "hybrid"])
def test_check_passes_on_cpu_and_openvino(openvino_venv, bundled_exports, exported, which, tmp_path):
    bindir, env = openvino_venv
    export_dir = bundled_exports("fp32") if which == "bundled" else exported("elu+1", **HYBRID)[1]
    got = run([bindir / "edgelin", "check", export_dir, "--providers", "cpu,openvino", "--threads", "1", "--json", tmp_path / "check.json"],
              env=env, cwd=tmp_path)
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["passed"] and report["golden"], got.stdout
    cpu, openvino = report["providers"]
    assert (cpu["name"], cpu["status"], openvino["name"], openvino["status"]) == ("cpu", "active", "openvino", "active")
    names = [r["name"].split(" (")[0] for r in openvino["results"]]
    assert names == ["prefill vs golden", "decode vs golden", "prefill vs cpu", "decode vs cpu"]
    assert all(r["passed"] and r["nonfinite"] == 0 for p in report["providers"] for r in p["results"])
    assert got.stdout.splitlines()[-1].startswith("PASS: 6 of 6 comparisons within budget")
