"""The wheel holds every module and bundled model file, under the one installed namespace ``edgelin``.

Builds the wheel for real (setuptools, no build isolation, no network) from a copy of the working tree,
so a stale build/ folder in the checkout can neither hide a missing module nor be polluted by the test.
Takes a few seconds to ~20 s; marked ``slow``.
"""

from __future__ import annotations

import configparser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package folder (pyproject's [tool.setuptools.package-dir])
PACKAGE_DIRS = {"edgelin": "edgelin", "exporters": "edgelin/exporters", "runtime": "edgelin/runtime", "models": "edgelin/models"}
IGNORED = shutil.ignore_patterns(".git", ".venv", "node_modules", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", "*.onnx")

PROBE_MODEL = "_packaging_probe"
PROBE_FILES = ("config.json", "model.safetensors", "README.md")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    # --no-build-isolation builds with this environment's setuptools: it must be new enough and able to
    # make wheels (setuptools >= 70.1 has bdist_wheel built in; older ones need the `wheel` package)
    import setuptools
    assert int(setuptools.__version__.split(".")[0]) >= 68, f"setuptools {setuptools.__version__} < 68"
    assert importlib.util.find_spec("setuptools.command.bdist_wheel") or importlib.util.find_spec("wheel"), (
        "building the wheel needs setuptools >= 70.1 or the `wheel` package in the test environment"
    )
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=IGNORED)
    # a stand-in bundled model, so the package-data rules are exercised before any real model exists
    probe = src / "models" / PROBE_MODEL
    probe.mkdir()
    for name in PROBE_FILES:
        (probe / name).write_text("{}\n" if name.endswith(".json") else "probe\n", encoding="utf-8")
    out = work / "dist"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"pip wheel failed:\n{result.stdout}\n{result.stderr}"
    wheels = list(out.glob("edgelin-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def expected_files() -> list[str]:
    """Installed paths of every .py module and every bundled model file in the working tree."""
    expected = []
    for src, dest in PACKAGE_DIRS.items():
        for path in sorted((ROOT / src).rglob("*.py")):
            rel = path.relative_to(ROOT / src)
            if "__pycache__" in rel.parts:
                continue
            expected.append(f"{dest}/{rel.as_posix()}")
    runtime = ROOT / "runtime"
    for pattern in ("schema/*.json", "web/*.mjs", "web/*.html"):  # the runtime's package-data
        for path in sorted(runtime.glob(pattern)):
            expected.append(f"edgelin/runtime/{path.relative_to(runtime).as_posix()}")
    models = ROOT / "models"
    for pattern in ("*/config.json", "*/model.safetensors", "*/*.md"):  # pyproject's package-data
        for path in sorted(models.glob(pattern)):
            expected.append(f"edgelin/models/{path.relative_to(models).as_posix()}")
    return expected


def test_the_expectation_covers_the_known_modules():
    files = expected_files()
    for known in ("edgelin/runtime/schema/edgelin-2.schema.json", "edgelin/runtime/web/edgelin.mjs", "edgelin/runtime/web/index.html", "edgelin/model.py", "edgelin/ops/chunk.py", "edgelin/runtime/manifest/__init__.py", "edgelin/exporters/__init__.py", "edgelin/models/__init__.py"):
        assert known in files


def test_every_module_and_model_file_is_in_the_wheel(wheel):
    names = set(wheel.namelist())
    missing = [path for path in expected_files() if path not in names]
    assert not missing, f"not in the wheel (add the package to [tool.setuptools] packages / package-data): {missing}"


def test_bundled_model_files_are_package_data(wheel):
    names = set(wheel.namelist())
    missing = [f for f in PROBE_FILES if f"edgelin/models/{PROBE_MODEL}/{f}" not in names]
    assert not missing, f"models/<name>/{missing} not in the wheel: check [tool.setuptools.package-data]"


def test_nothing_lands_outside_the_namespace(wheel):
    """No top-level runtime/ or exporters/ package that would shadow other installs; no tests in the wheel."""
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert "edgelin" in tops and all(t == "edgelin" or t.endswith(".dist-info") for t in tops), sorted(tops)
    assert not [n for n in wheel.namelist() if n.startswith("edgelin/tests/") or "/__pycache__/" in n]


def test_the_edgelin_command_is_declared(wheel):
    [entry_points] = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    assert parser.get("console_scripts", "edgelin") == "edgelin.cli:main"
