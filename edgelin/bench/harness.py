"""The measurement harness every section shares: statistics, interleaved calls, alternating rounds, the machine
and its load, and the other programs a section times (a command, a node script).

Torch-free (numpy and onnxruntime's metadata only), so the prefill worker and the scripts that run in a device's
torch-free environment can use it.

    stats / ratio / median_of    a figure: median with p10/p90/min/max/n; the ratio of two medians
    interleaved                  many short calls: contenders take turns in blocks, the order rotating every round
    alternating                  a few long measurements: one of each contender per round, the order reversed every
                                 other round; each returns its figures, the medians are taken over the rounds
    machine_facts / busy         cores, caches, memory, versions, the load average at the start and whether it was busy
    run_command / node_json      another program's output, failing in one line (the llamacpp, transformers and
                                 lowering sections' workers and node scripts)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgelin import __version__

ROOT = Path(__file__).resolve().parents[2]  # a source checkout: scripts/ and node_modules/ beside edgelin/
JS_PACKAGES = {"node": "onnxruntime-node", "wasm": "onnxruntime-web"}  # edgelin's JavaScript runtimes timed by the bench


# ---- statistics -------------------------------------------------------------------------------------
def stats(seconds: list[float], unit: str = "ms") -> dict[str, Any]:
    """Median, p10, p90, min, max of samples given in seconds, converted to ``unit`` (ms or s)."""
    scale = {"ms": 1e3, "s": 1.0}[unit]
    a = np.asarray(seconds, dtype=np.float64) * scale
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return {"unit": unit, "median": float(med), "p10": float(p10), "p90": float(p90),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


def ratio(a: dict, b: dict) -> float:
    """Ratio of the medians of two ``stats`` results."""
    return a["median"] / b["median"]


def median_of(rounds: list[dict[str, float]], key: str) -> float:
    """The median of one figure over rounds (each a dict of figures, as ``alternating`` gives them)."""
    return float(np.median([r[key] for r in rounds]))


# ---- timing -----------------------------------------------------------------------------------------
def interleaved(cases: dict[str, Callable[[], Any]], *, warmup: int, rounds: int, per_round: int) -> dict[str, list[float]]:
    """Time each callable ``rounds * per_round`` times (seconds per call), after ``warmup`` calls each.

    The contenders take turns in blocks of ``per_round`` calls, and the order rotates every round, so a
    change in machine load during the measurement falls on all of them alike.
    """
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    clock = time.perf_counter
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, out = cases[name], samples[name]
            for _ in range(per_round):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return samples


def round_order(names: list[str] | tuple[str, ...], r: int) -> list[str]:
    """The contenders' order in round ``r``: as given in even rounds, reversed in odd ones (none always goes first)."""
    return list(names) if r % 2 == 0 else list(names)[::-1]


def alternating(cases: dict[str, Callable[[int], dict[str, float]]], rounds: int) -> dict[str, list[dict[str, float]]]:
    """Run each measurement once per round, the order alternating (``round_order``): per contender, the figures of
    each round (what its callable, given the round's number, returned)."""
    out: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for r in range(rounds):
        for name in round_order(list(cases), r):
            out[name].append(cases[name](r))
    return out


def medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """``alternating``'s rounds as "CONTENDER/FIGURE" -> the median over the rounds."""
    return {f"{name}/{key}": median_of(got, key) for name, got in rounds.items() for key in (got[0] if got else {})}


# ---- the machine ------------------------------------------------------------------------------------
def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def proc_bytes(path: str, key: str) -> int | None:
    """A "Key: N kB" line of a /proc file, in bytes."""
    for line in _read(path).splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def meminfo(key: str) -> int | None:
    return proc_bytes("/proc/meminfo", key)


def caches() -> dict[str, str]:
    """CPU 0's caches, e.g. {"L1d": "48K", "L2": "2048K", "L3": "260M"}."""
    found = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.is_dir() else []:
        level, kind, size = (_read(index / f).strip() for f in ("level", "type", "size"))
        if level and size:
            found[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
    return found


def cache_bytes(text: str) -> int | None:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip()
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text and text[-1].upper() in units else int(text)
    except ValueError:
        return None


VERSIONED = (("onnxruntime", ("onnxruntime-gpu", "onnxruntime")), ("torch", ("torch",)), ("onnx", ("onnx",)),
             ("onnxscript", ("onnxscript",)), ("matplotlib", ("matplotlib",)))


def dist_version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` that is installed (read from metadata: nothing imported)."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine_facts() -> dict[str, Any]:
    """Cores, CPU model, caches, memory, load and library versions (read from metadata: nothing imported)."""
    import onnxruntime as ort

    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines() if line.startswith("model name")), platform.processor())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    versions = {"python": platform.python_version(), "numpy": np.__version__, "edgelin": __version__}
    versions.update({name: dist_version(*dists) for name, dists in VERSIONED})
    return {
        "cpu_model": model or "unknown", "cores": os.cpu_count(), "usable_cores": usable, "caches": caches(),
        "memory_total_bytes": meminfo("MemTotal"), "memory_available_bytes": meminfo("MemAvailable"),
        "platform": platform.platform(), "versions": versions, "ort_available_providers": ort.get_available_providers(),
        "load_average_start": load_average(),
    }


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def busy(machine: dict) -> dict[str, Any]:
    """Whether the machine was busy when the run started: its 1-minute load above half its usable cores."""
    load = machine.get("load_average_start") or [0.0]
    cores = machine.get("usable_cores") or 1
    return {"load_1min_start": load[0], "cores": cores, "busy": load[0] > 0.5 * cores,
            "note": "numbers from a busy machine are not representative" if load[0] > 0.5 * cores else ""}


# ---- other programs ---------------------------------------------------------------------------------
def run_command(cmd: list, what: str, error: type[Exception], timeout: float, **kw: Any) -> str:
    """A program's stdout; ``error`` naming ``what`` and its last line of stderr if it fails or outlives ``timeout``."""
    try:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    except subprocess.TimeoutExpired:
        raise error(f"{what} did not finish within {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        raise error(f"{what} failed: {(lines or [f'exit status {done.returncode}'])[-1][:300]}")
    return done.stdout


def node_json(script: Path, package: str, args: list, timeout: float = 3600) -> dict[str, Any]:
    """Run a bench script of scripts/ in node with ``package`` (one of JS_PACKAGES' values) and ``args``: the JSON
    of its last stdout line, or {"status": "skipped"|"failed", "reason": ...}."""
    node = shutil.which("node")
    if node is None or not script.is_file() or not (ROOT / "node_modules" / package).is_dir():
        return {"status": "skipped", "reason": f"needs node and a source checkout with node_modules/{package} (npm ci)"}
    done = subprocess.run([node, str(script), package, *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else f"exit status {done.returncode}")
        return {"status": "failed", "reason": why[:300]}  # node's last line is its version: the error's line says more
    return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["JS_PACKAGES", "alternating", "busy", "cache_bytes", "caches", "dist_version", "interleaved", "load_average",
           "machine_facts", "median_of", "medians", "meminfo", "node_json", "proc_bytes", "ratio", "round_order", "run_command",
           "stats"]
