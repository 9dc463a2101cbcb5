"""node, npm packages and a browser for the JavaScript-runtime tests: each helper skips its test with the reason
when the thing is missing.

The npm packages are found in ``EDGELIN_NODE_MODULES`` or ``node_modules/`` at the repository root
(``ONNXRUNTIME_NODE_INSTALL=skip npm install`` there, as .ci/run does).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def node_modules() -> Path:
    return Path(os.environ.get("EDGELIN_NODE_MODULES") or ROOT / "node_modules")


def npm_package(name: str) -> Path:
    """The folder of an installed npm package; skips the test with the reason if it is missing."""
    path = node_modules() / name
    if not (path / "package.json").is_file():
        pytest.skip(f"npm package {name} is not installed in {node_modules()} (run `ONNXRUNTIME_NODE_INSTALL=skip npm install` at the repository root)")
    return path


def executable(name: str, *alternatives: str) -> str:
    for n in (name, *alternatives):
        found = shutil.which(n)
        if found:
            return found
    pytest.skip(f"{name} is not installed (apt-get install {name})")
