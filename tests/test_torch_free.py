"""``import edgelin`` and the runtime never import torch (a device may have only numpy + onnxruntime).

Checked three ways: in a subprocess where importing torch raises ImportError; in a subprocess where
torch is importable but must stay unimported; and by reading the runtime's source for imports of torch,
the exporters or edgelin's torch modules.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "runtime"

# importing any of these must not need torch
TORCH_FREE = ["edgelin", "edgelin.runtime", "edgelin.runtime.manifest", "edgelin.config", "edgelin.errors", "edgelin.importers.catalog"]
# the runtime may import none of these (torch itself, the exporters, edgelin's torch modules)
FORBIDDEN_IN_RUNTIME = (
    "torch", "edgelin.exporters", "edgelin.model", "edgelin.ops", "edgelin.layers",
    "edgelin.checkpoint", "edgelin.validate",
)

TEXTUAL_IMPORT = re.compile(
    r"(^\s*|[;:'\"]\s*)(import|from)\s+(torch|edgelin\.exporters|exporters)\b"
    r"|import_module\(\s*['\"](torch|edgelin\.exporters)"
    r"|__import__\(\s*['\"](torch|edgelin\.exporters)"
)

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test (import of {name!r})")
            return None

    sys.meta_path.insert(0, BlockTorch())
    """
)

PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    results = {}
    for name in NAMES:
        try:
            importlib.import_module(name)
            results[name] = None
        except BaseException as exc:
            results[name] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"results": results, "torch_loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))}))
    """
)


def runtime_modules() -> list[str]:
    """edgelin.runtime and every module under runtime/, by file."""
    names = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        names.append(".".join(["edgelin.runtime", *parts]))
    return names


def probe(names: list[str], *, block_torch: bool) -> dict:
    code = (BLOCKER if block_torch else "") + f"NAMES = {names!r}\n" + PROBE
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_torch_free_modules_import_without_torch():
    names = TORCH_FREE + [m for m in runtime_modules() if m not in TORCH_FREE] + ["edgelin.model"]
    report = probe(names, block_torch=True)
    failures = {name: err for name, err in report["results"].items() if err is not None and name != "edgelin.model"}
    assert not failures, f"these imports need torch (or failed otherwise): {failures}"
    # the blocker works: the torch side of the package does fail to import
    assert report["results"]["edgelin.model"] is not None
    assert "torch is blocked" in report["results"]["edgelin.model"]


def test_torch_free_modules_leave_torch_unimported():
    """With torch installed, importing the light modules still loads none of it (no optional fallback)."""
    report = probe(TORCH_FREE + runtime_modules(), block_torch=False)
    assert all(err is None for err in report["results"].values()), report["results"]
    assert report["torch_loaded"] == [], f"torch got imported: {report['torch_loaded'][:5]}"


def _imported_names(path: Path, runtime_root: Path = RUNTIME) -> list[str]:
    """Absolute names of every import in a runtime source file (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ["edgelin", "runtime", *path.relative_to(runtime_root).parent.parts]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                if base[:2] == ["edgelin", "runtime"]:
                    base = ["edgelin.runtime"] + base[2:]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__"):
            names.extend(arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant) and isinstance(arg.value, str))
    return names


def test_runtime_source_imports_no_torch_and_no_exporters():
    files = sorted(RUNTIME.rglob("*.py"))
    assert RUNTIME / "manifest" / "__init__.py" in files
    offending = {}
    for path in files:
        bad = sorted({
            name for name in _imported_names(path)
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_RUNTIME)
        })
        if bad:
            offending[str(path.relative_to(ROOT))] = bad
        # belt and braces: a plain-text search of every line, also inside strings given to exec()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if TEXTUAL_IMPORT.search(line):
                offending.setdefault(str(path.relative_to(ROOT)), []).append(f"line {number}: {line.strip()}")
    assert not offending, f"the runtime must use only numpy, onnxruntime and the standard library: {offending}"


def test_the_source_check_has_teeth(tmp_path):
    """_imported_names sees the import forms the check relies on."""
    fake = tmp_path / "runtime" / "sub" / "mod.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "import numpy\nimport torch.nn as nn\nfrom torch import Tensor\n"
        "def f():\n    import edgelin.exporters.export\n"
        "from ..manifest import Manifest\nfrom ... import model\n"
        "import importlib\nimportlib.import_module('torch')\n",
        encoding="utf-8",
    )
    names = _imported_names(fake, tmp_path / "runtime")
    for expected in ("numpy", "torch.nn", "torch", "edgelin.exporters.export", "edgelin.runtime.manifest.Manifest", "edgelin.model"):
        assert expected in names, (expected, names)


def test_the_text_check_has_teeth():
    caught = ["import torch", "    from torch import nn", "x = 1; import torch", "exec('import torch')",
              "importlib.import_module('torch.nn')", "from edgelin.exporters import export", "    import exporters.graphs"]
    ignored = ["# written by edgelin.exporters", '"""numpy only, never torch"""', "import torchvision_like", "from . import state"]
    assert all(TEXTUAL_IMPORT.search(line) for line in caught)
    assert not any(TEXTUAL_IMPORT.search(line) for line in ignored)


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where importing torch raises ImportError."""
    return subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


# ---- the runtime's real work without torch: load an export, generate, save a state, the CLI ----

def test_the_blocker_really_blocks_torch():
    proc = run_without_torch("import torch")
    assert proc.returncode != 0 and "torch is blocked" in proc.stderr


def test_import_and_generate_without_torch(exported, tmp_path):
    _, export_dir = exported("elu+1")
    proc = run_without_torch(
        f"""
        import json, sys
        import edgelin.runtime as rt
        import edgelin.cli.generate
        result = rt.generate_text({str(export_dir)!r}, "Hello", max_new_tokens=16, provider="cpu",
                                  state_out={str(tmp_path / "s.npz")!r})
        gen = rt.Generator(rt.load({str(export_dir)!r}, provider="cpu"), ["a", "bcd"], max_new_tokens=4, temperature=0.5, seed=0)
        gen.run()
        print(json.dumps({{"text": result["text"], "tokens": result["new_tokens"], "batch": gen.state.batch,
                          "torch": [m for m in sys.modules if m == "torch" or m.startswith("torch.")]}}))
        """
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tokens"] == 16 and out["batch"] == 2 and out["torch"] == []
    assert (tmp_path / "s.npz").is_file()


def test_cli_generate_runs_without_torch(exported):
    tiny = exported("elu+1")
    proc = run_without_torch(
        f"""
        from edgelin.cli.generate import generate
        generate.main([{str(tiny[1])!r}, "--prompt", "Hi", "-n", "5", "--provider", "cpu", "--json"], standalone_mode=True)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert '"new_tokens": 5' in proc.stdout
