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


CHECK_SCRIPT = """
import { readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { join } from "node:path";
const edgelin = await import(process.argv[2]);
const ort = createRequire(join(process.argv[3], "package.json"))(process.argv[3]);
const read = (name) => readFile(join(process.argv[4], name)).then((b) => new Uint8Array(b));
const model = await edgelin.loadExport(ort, read, { sessionOptions: { executionProviders: ["cpu"], intraOpNumThreads: 1 } });
console.log(JSON.stringify(await model.check()));
"""


def javascript_check(export_dir: Path, scratch: Path) -> dict:
    """The JavaScript runtime (runtime/web/edgelin.mjs, the module the browser page runs) in node with
    onnxruntime-node: loads ``export_dir`` (its manifest checked against the graphs) and runs ``Model.check()``
    against the export's golden outputs. Returns its report {passed, results, ...}; skips where node or
    onnxruntime-node is missing."""
    import json
    import subprocess

    node, ort = executable("node", "nodejs"), npm_package("onnxruntime-node")
    script = scratch / "edgelin-check.mjs"
    script.write_text(CHECK_SCRIPT)
    r = subprocess.run([node, str(script), (ROOT / "runtime" / "web" / "edgelin.mjs").as_uri(), str(ort), str(export_dir)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the JavaScript runtime failed on {export_dir}: {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])
