"""The genai section's cache folder (``default_dir``): onnxruntime-genai's virtual environment, made on first use
(``ensure_venv``), and the stamps that say what made each folder the section keeps there (a checkpoint, genai's build,
an edgelin export: reused while what made it is unchanged)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .plan import BenchError, Progress

ENV_DIR = "EDGELIN_GENAI_DIR"  # the cache folder: venv/, and per model its checkpoint and exports
VENV_PACKAGES = ("onnxruntime-genai==0.18.*", "transformers", "onnx", "onnx-ir", "torch==2.13.0")
STAMP = "edgelin-bench-genai.json"  # in each folder this section made: what made it


# ---- the cache folder, the venv ---------------------------------------------------------------------
def default_dir(environ: os._Environ | dict = os.environ) -> Path:
    """``$EDGELIN_GENAI_DIR``, else ``$XDG_CACHE_HOME/edgelin/genai``, else ``~/.cache/edgelin/genai``."""
    if environ.get(ENV_DIR):
        return Path(environ[ENV_DIR]).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "edgelin" / "genai"


def default_record_dir(out_dir: str | os.PathLike) -> Path:
    """Where the per-model records go: docs/bench of this source checkout, else the bench's output folder."""
    from .harness import ROOT

    docs = ROOT / "docs" / "bench"
    return docs if docs.is_dir() else Path(out_dir)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def install_command(venv: Path) -> str:
    return f"python -m venv {venv} && {venv_python(venv)} -m pip install " + " ".join(f"'{p}'" for p in VENV_PACKAGES)


PROBE = "import json, onnxruntime_genai as og, onnxruntime as ort; print(json.dumps({'onnxruntime_genai': og.__version__, 'onnxruntime': ort.__version__}))"


def probe_venv(venv: Path) -> dict[str, str] | None:
    """{"onnxruntime_genai": version, "onnxruntime": version} of the venv's Python, or None where it has no genai."""
    py = venv_python(venv)
    if not py.is_file():
        return None
    done = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None


def ensure_venv(venv: Path | None, cache: Path, say: Progress) -> tuple[Path, dict[str, str]]:
    """(the venv's Python, its versions): the venv named (which must hold onnxruntime-genai), or ``cache/venv``, made on
    first use (``VENV_PACKAGES``; about a minute, 1.5 GB). BenchError, one line saying what to do, otherwise."""
    if venv is not None:
        found = probe_venv(venv)
        if found is None:
            raise BenchError(f"{venv} is not a virtual environment with onnxruntime-genai; make it: {install_command(venv)} "
                             "(or leave --genai-venv out: edgelin makes one in its cache folder)")
        return venv_python(venv), found
    venv = cache / "venv"
    found = probe_venv(venv)
    if found is not None:
        return venv_python(venv), found
    say(f"genai: making onnxruntime-genai's venv in {venv} (first use: pip install {' '.join(VENV_PACKAGES)}; about a minute, 1.5 GB) ...")
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "venv-install.log"
    with open(log, "w") as out:
        for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)], [str(venv_python(venv)), "-m", "pip", "install", *VENV_PACKAGES]):
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode != 0:
                raise BenchError(f"could not make onnxruntime-genai's venv in {venv} ({last_line(log)}; log {log}); make it by hand: "
                                 f"{install_command(venv)}, then pass --genai-venv {venv}")
    found = probe_venv(venv)
    if found is None:
        raise BenchError(f"{venv} was made but onnxruntime-genai does not import there; log {log}")
    return venv_python(venv), found


def last_line(log: Path) -> str:
    """The last line of a log that says something (an error's, as a rule), shortened."""
    lines = [x.strip() for x in log.read_text(errors="replace").replace("\r", "\n").splitlines() if x.strip()] if log.is_file() else []
    errors = [x for x in lines if "Error" in x or "error" in x]
    return ((errors or lines or ["no output"])[-1])[:300]


# ---- what made a folder: stamps ---------------------------------------------------------------------------
def folder_fingerprint(folder: Path) -> str:
    """A checkpoint folder's identity: its config.json and its weight files' names, sizes and times."""
    h = hashlib.sha256((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def code_fingerprint() -> str:
    """edgelin's code as it is now (every .py of its packages but the bench's and the CLI's): an export made by other code is
    made again."""
    import importlib.util

    h = hashlib.sha256()
    for pkg in ("edgelin", "edgelin.exporters", "edgelin.runtime"):
        spec = importlib.util.find_spec(pkg)
        for base in spec.submodule_search_locations or [] if spec else []:
            for f in sorted(Path(base).rglob("*.py")):
                if f.relative_to(base).parts[0] in ("bench", "cli"):
                    continue
                h.update(str(f.relative_to(base)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def stamped(folder: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def stamp_it(folder: Path, stamp: dict[str, Any]) -> None:
    (folder / STAMP).write_text(json.dumps(stamp, indent=1))


def fresh(folder: Path) -> Path:
    """``folder`` (one of this section's, under its cache folder) emptied."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


__all__ = ["ENV_DIR", "PROBE", "STAMP", "VENV_PACKAGES", "code_fingerprint", "default_dir", "default_record_dir", "ensure_venv", "folder_fingerprint", "fresh", "install_command", "last_line", "probe_venv", "stamp_it", "stamped", "venv_python"]
