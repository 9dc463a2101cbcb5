"""Where a decode step's time goes, from ONNX Runtime's own profile (read from its files: no session needed).

ONNX Runtime writes a profile when a session is made with profiling on (``SessionOptions.enable_profiling``; in
onnxruntime-genai, the decoder's ``session_options.enable_profiling`` prefix): a JSON list of events, one
``model_run`` (category "Session") per ``run`` call and, inside it, one ``<node>_kernel_time`` event (category "Node",
``args.op_name``) per node executed. ``decode_profile`` keeps the last ``steps`` runs of one such file (a decode session
profiles only decode steps; genai's one session runs the prompt first) and gives each operator type's kernel time in the
median run: what the genai section records beside its timings, so that a missed target says which operators cost what
per step.
The profiled runs are separate from the timed ones (profiling slows every node a little).
"""

from __future__ import annotations

import bisect
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from .plan import BenchError


def decode_profile(path: str | Path, steps: int) -> dict[str, Any]:
    """The last ``steps`` runs of the ONNX Runtime profile ``path``: per operator type the median over those runs of its
    kernel microseconds in a run, and its nodes per run (largest first); the median run's total kernel time and wall
    time (µs). Medians, as the timed rounds take the median step: the first steps after a prompt (fresh state buffers, the
    allocator growing) cost several times a steady one and would move a mean. BenchError where the file is not such a
    profile or holds fewer runs."""
    try:
        events = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"ONNX Runtime profile {path}: {exc}") from None
    if not isinstance(events, list):
        raise BenchError(f"ONNX Runtime profile {path}: not a list of events")
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if isinstance(e, dict) and e.get("name") == "model_run")
    if steps < 1 or len(runs) < steps:
        raise BenchError(f"ONNX Runtime profile {path}: {len(runs)} run(s), {steps} asked for")
    kept = runs[-steps:]
    starts = [a for a, _ in kept]
    time: dict[str, list[float]] = defaultdict(lambda: [0.0] * steps)  # op -> its kernel µs in each kept run
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if not (isinstance(e, dict) and e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1  # the last kept run that starts at or before the event
        if i < 0 or e["ts"] > kept[i][1]:
            continue
        op = e.get("args", {}).get("op_name", "?")
        time[op][i] += e["dur"]
        count[op] += 1
    median = {op: statistics.median(per_run) for op, per_run in time.items()}
    order = sorted(median, key=lambda op: (-median[op], op))
    totals = [sum(per_run[i] for per_run in time.values()) for i in range(steps)]
    return {"steps": steps, "kernel_us": statistics.median(totals), "run_us": statistics.median(b - a for a, b in kept),
            "ops": {op: {"us": median[op], "nodes": count[op] / steps} for op in order}}


def compare_lines(profiles: dict[str, dict[str, Any]], top: int = 8) -> list[str]:
    """Operator types side by side, µs per decode step for each contender of ``profiles`` (name -> ``decode_profile``): the
    ``top`` costliest of any of them, then the rest summed, then the kernel totals."""
    names = list(profiles)
    ops: dict[str, float] = {}
    for p in profiles.values():
        for op, v in p["ops"].items():
            ops[op] = max(ops.get(op, 0.0), v["us"])
    shown = sorted(ops, key=lambda op: (-ops[op], op))[:top]
    width = max([len(n) for n in names] + [14])
    lines = [f"{'µs per decode step':34s} " + " ".join(f"{n:>{width}s}" for n in names)]

    def cell(p: dict[str, Any], op: str) -> str:
        v = p["ops"].get(op)
        return "-" if v is None else f"{v['us']:,.0f} ({v['nodes']:.0f})"

    for op in shown:
        lines.append(f"{op:34s} " + " ".join(f"{cell(profiles[n], op):>{width}s}" for n in names))
    rest = {n: sum(v["us"] for op, v in p["ops"].items() if op not in shown) for n, p in profiles.items()}
    lines.append(f"{'other operators':34s} " + " ".join(f"{rest[n]:>{width},.0f}" for n in names))
    lines.append(f"{'all kernels':34s} " + " ".join(f"{profiles[n]['kernel_us']:>{width},.0f}" for n in names))
    return lines


__all__ = ["compare_lines", "decode_profile"]
