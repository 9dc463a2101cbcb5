"""What the JavaScript-runtime tests need: node with onnxruntime-node, onnxruntime-web, chromium, and
the bundled model's export. Each fixture skips its tests with the reason when something is missing.

The npm packages are found in ``EDGELIN_NODE_MODULES`` or ``node_modules/`` at the repository root
(``ONNXRUNTIME_NODE_INSTALL=skip npm install`` there, as .ci/run does).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from testkit.node import executable, npm_package


@pytest.fixture(scope="session")
def bundled_export(bundled_exports):
    """The bundled model's fp32 export, the one the whole run shares (tests/conftest.py)."""
    return bundled_exports("fp32")


@pytest.fixture(scope="session")
def node() -> str:
    return executable("node", "nodejs")


@pytest.fixture(scope="session")
def ort_node() -> Path:
    return npm_package("onnxruntime-node")


@pytest.fixture(scope="session")
def ort_web() -> Path:
    return npm_package("onnxruntime-web")


@pytest.fixture(scope="session")
def chromium() -> str:
    return executable("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="session")
def python_greedy():
    """(export dir, prompt ids, n, piece) -> dict of the Python runtime's greedy run on one CPU thread:
    all prefill logits, the greedy ids, the logits of each decode step, the text."""
    from edgelin.runtime import Generator, load

    sessions = {}

    def run(export_dir, ids, n, piece):
        if export_dir not in sessions:
            sessions[export_dir] = load(export_dir, provider="cpu", threads=1)
        s = sessions[export_dir]
        state = s.new_state(1)
        logits = s.prefill(np.asarray([ids]), state, chunk=piece)[0]  # [T, V]
        out, steps = [], []
        last = logits[-1]
        for i in range(n):
            tok = int(last.argmax())
            out.append(tok)
            if i + 1 < n:
                last = s.decode([[tok]], state)[0, 0]  # [V]
                steps.append(last)
        gen = Generator(s, [ids], max_new_tokens=n, prefill_chunk=piece).run()
        assert gen.results[0].ids == out  # the streaming generator agrees with the loop above
        return {"prefill_logits": logits, "greedy_ids": out, "decode_logits": steps, "text": gen.text}

    return run
