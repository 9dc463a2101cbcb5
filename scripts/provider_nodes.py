"""Which execution provider takes which nodes of an export's graphs, as ONNX Runtime places them.

    python scripts/provider_nodes.py EXPORT --provider openvino [--json out.json]

Opens each graph on the provider (the CPU provider taking what it does not) with ONNX Runtime's verbose log,
and reads the placement ONNX Runtime logs ("Node(s) placed on [...]", then one line per node): how many nodes
each provider holds and, for the CPU fallback, each node's op type and name. A provider that fuses what it
takes (OpenVINO compiles it into one subgraph) shows few nodes. Torch-free: runs in a device's venv. Providers of
an onnxruntime build only (a plugin such as webgpu: set SessionOptions.log_severity_level=0 yourself).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import onnxruntime as ort

from edgelin.runtime.manifest import GRAPHS, Manifest
from edgelin.runtime.providers import CPU_EP, EXECUTION_PROVIDERS, PLUGIN_PROVIDERS

PLACED = re.compile(r"placed on \[(\w+)\]\. Number of nodes: (\d+)")
NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s+(\S+) \((.*)\)\s*$")


def placement(path: Path, ep: str) -> dict[str, dict]:
    """{provider: {"nodes": n, "ops": [[op type, node name], ...]}} for one graph."""
    so = ort.SessionOptions()
    so.log_severity_level = 0
    so.log_verbosity_level = 0
    with tempfile.TemporaryFile(mode="w+b") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            sess = ort.InferenceSession(str(path), so, providers=[ep, CPU_EP])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode("utf-8", "replace").splitlines()
    if sess.get_providers()[0] != ep:
        raise SystemExit(f"{ep} did not activate for {path.name} (it runs on {', '.join(sess.get_providers())})")
    out: dict[str, dict] = {}
    current = None
    for line in lines:
        m = PLACED.search(line)
        if m:
            current = m.group(1)
            out[current] = {"nodes": int(m.group(2)), "ops": []}
            continue
        n = NODE.search(line)
        if n and current is not None:
            out[current]["ops"].append([n.group(1), n.group(2)])
        elif current is not None and "VerifyEachNodeIsAssignedToAnEp" not in line:
            current = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("export_dir", type=Path)
    ap.add_argument("--provider", default="openvino", choices=[p for p in EXECUTION_PROVIDERS if p not in ("cpu", *PLUGIN_PROVIDERS)])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    manifest = Manifest.load(args.export_dir)
    ep = EXECUTION_PROVIDERS[args.provider][0]
    if ep not in ort.get_available_providers():
        raise SystemExit(f"this onnxruntime build has no {ep}; install {EXECUTION_PROVIDERS[args.provider][1]}")
    result = {g: placement(manifest.graph_path(args.export_dir, g), ep) for g in GRAPHS}
    for g, where in result.items():
        parts = []
        for provider, d in where.items():
            ops = sorted({op for op, _ in d["ops"]}) if provider == CPU_EP else []
            parts.append(f"{provider}: {d['nodes']} node(s)" + (f" ({', '.join(ops)})" if ops else ""))
        print(f"{g}: " + "; ".join(parts))
    if args.json:
        args.json.write_text(json.dumps({"export": str(args.export_dir), "provider": ep, "graphs": result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
