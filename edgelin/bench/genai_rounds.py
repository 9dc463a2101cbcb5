"""The genai section's measurements, each in a process of its own (``edgelin.bench.genai``): one round of genai
(``GENAI_ROUND``, run by the Python of genai's venv), one round of edgelin (``python -m edgelin.bench --genai-round SPEC``:
``edgelin_round_main``, torch-free), either with ONNX Runtime's profiler on where the spec names a folder for it, and the
nodes of a graph as ONNX Runtime runs it (``COUNT``); ``measure_process`` runs one and reads its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .harness import stats

TIMEOUT = 3600.0  # seconds for one build, export or measuring process


# ---- one measurement, in its own process --------------------------------------------------------------
EDGELIN_ROUND = "python -m edgelin.bench --genai-round SPEC"

GENAI_ROUND = r"""
import json, sys, time
import numpy as np
import onnxruntime_genai as og
spec = json.loads(sys.argv[1])
prompt = np.asarray(spec["prompt"], dtype=np.int32)
cfg = og.Config(spec["folder"])
options = {"intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}
if spec.get("profile"):  # ONNX Runtime's profile of the decoder's session, written as the model is let go
    options["enable_profiling"] = spec["profile"] + "/genai"
cfg.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
t = time.perf_counter()
model = og.Model(cfg)
load_s = time.perf_counter() - t

def run(steps):
    params = og.GeneratorParams(model)
    # min_length = max_length: no end-of-sequence stop before the last step (random weights may pick that token)
    params.set_search_options(max_length=len(prompt) + steps + 1, min_length=len(prompt) + steps + 1, do_sample=False)
    gen = og.Generator(model, params)
    t = time.perf_counter()
    gen.append_tokens(prompt)
    prefill = time.perf_counter() - t
    times, ids = [], []
    for _ in range(steps):
        t = time.perf_counter()
        gen.generate_next_token()
        times.append(time.perf_counter() - t)
        ids.append(int(gen.get_next_tokens()[0]))
    return prefill, times, ids

run(spec["warmup"])
prefill, times, ids = run(spec["decode"])
result = {"load_s": load_s, "prefill_s": prefill, "decode_s": times, "ids": ids}
if spec.get("profile"):
    import gc, glob
    del model
    gc.collect()
    result["profile"] = (sorted(glob.glob(spec["profile"] + "/genai*.json")) or [None])[-1]
print(json.dumps(result))
"""


def edgelin_round_main(spec: dict[str, Any]) -> None:
    """In ``python -m edgelin.bench --genai-round SPEC``: one edgelin measurement like GENAI_ROUND's (torch-free): load,
    warm up, one prefill call of the prompt, then greedy steps (argmax + Session.decode), printed as JSON."""
    from edgelin.runtime.session import Session

    prompt = np.asarray([spec["prompt"]], dtype=np.int64)  # [1, L]
    options: dict[str, Any] = {"inter_op_num_threads": 1}
    if spec.get("profile"):  # ONNX Runtime's profile of both graphs' sessions; the decode graph's is the one read
        options.update(enable_profiling=True, profile_file_prefix=str(Path(spec["profile"]) / "edgelin"))
    t = time.perf_counter()
    sess = Session(spec["folder"], "cpu", spec["threads"], session_options=options, io_binding=True)
    load_s = time.perf_counter() - t

    def run(steps: int) -> tuple[float, list[float], list[int]]:
        state = sess.new_state(1)
        t = time.perf_counter()
        logits = sess.prefill(prompt, state, last_only=True)  # [1, V]: one call (the prompt is shorter than a piece)
        prefill = time.perf_counter() - t
        times, ids = [], []
        for _ in range(steps):
            t = time.perf_counter()
            ids.append(int(logits[0].argmax()))
            logits = sess.decode(np.asarray([[ids[-1]]], dtype=np.int64), state)[:, -1]  # [1, V]
            times.append(time.perf_counter() - t)
        return prefill, times, ids

    run(spec["warmup"])
    prefill, times, ids = run(spec["decode"])
    result: dict[str, Any] = {"load_s": load_s, "prefill_s": prefill, "decode_s": times, "ids": ids}
    if spec.get("profile"):
        result["profile"] = sess.end_profiling().get("decode")
    print(json.dumps(result))


# Runs argv[2:] as its child and writes "PEAK STATUS" to argv[1]: the child's ru_maxrss in bytes and its exit status as
# subprocess gives it. A small launcher: Linux counts in a process's ru_maxrss the resident memory of the process that
# forked it as it stood at the fork (and a vfork from the bench's own large process would count all of the bench's).
LAUNCH = r"""
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss * 1024} {os.waitstatus_to_exitcode(status)}")
"""


def run_peak(cmd: list[str], timeout: float = TIMEOUT, **popen: Any) -> tuple[int | None, str, str, int]:
    """Run ``cmd`` to its end: (its exit status as subprocess gives it, or None where it ran past ``timeout`` seconds and
    was killed; its stdout; its stderr; its peak resident memory in bytes: the kernel's ``ru_maxrss`` of that process,
    which counts the pages of its mapped files it touched as well as its own, and at most ~10 MB of ``LAUNCH``'s)."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path, peak_path = (os.path.join(tmp, n) for n in ("out", "err", "peak"))
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCH, peak_path, *map(str, cmd)], stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True, **popen)
            try:
                proc.wait(timeout)
                late = False
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
                late = True
        text = [Path(x).read_text(errors="replace") for x in (out_path, err_path)]
        peak, code = (int(x) for x in Path(peak_path).read_text().split()) if os.path.exists(peak_path) else (0, proc.returncode)
    return (None if late else code), text[0], text[1], peak


def measure_process(cmd: list[str], what: str) -> dict[str, Any]:
    """One measuring process's JSON (its last stdout line) with its peak resident memory (``peak_rss_bytes``), or
    {"status": "failed", "reason": ...}."""
    code, stdout, stderr, peak = run_peak(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if code is None:
        return {"status": "failed", "reason": f"{what} did not finish within {TIMEOUT:.0f} s"}
    lines = [x for x in stdout.strip().splitlines() if x.strip()]
    if code != 0 or not lines:
        errs = [x.strip() for x in stderr.splitlines() if x.strip()]
        why = f"killed by signal {-code}" if code < 0 else (errs or [f"exit status {code}"])[-1][:300]
        return {"status": "failed", "reason": f"{what}: {why}"}
    try:
        got = json.loads(lines[-1])
    except ValueError:
        return {"status": "failed", "reason": f"{what} printed no result: {lines[-1][:200]}"}
    return {**got, "peak_rss_bytes": peak} if isinstance(got, dict) else got


def figures(raw: dict[str, Any], prompt: int) -> dict[str, Any]:
    """A measuring process's result as the record's figures: prefill tokens/s, decode median step (ms, tokens/s)."""
    if "status" in raw:
        return raw
    step = stats(raw["decode_s"])
    return {"prefill_tokens_per_s": prompt / raw["prefill_s"], "decode_ms": step["median"], "decode_tokens_per_s": 1e3 / step["median"],
            "decode_p10_p90_ms": [step["p10"], step["p90"]], "load_s": raw["load_s"], "ids": raw["ids"],
            "peak_rss_bytes": raw.get("peak_rss_bytes")}


def ratio_rounds(ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """How far one contender's rounds resolve its ratio to another's (tokens/s, higher is faster; round r of each ran
    back to back). A process's speed on a shared machine can move by a third from one process to the next (two
    memory-bound decode processes of the same graph, one after the other: 80 and 110 ms a step), so the ratio of the
    medians alone can say 0.8 or 1.04 of the same two graphs. Returned beside it: ``best``, the fastest round of each
    (what each reaches when the machine lets it); ``paired``, the median and range of the ratios of the rounds run
    back to back; ``span``, the least and most any round of one over any round of the other; and ``verdict``:
    "faster" or "slower" where every pairing says so, else "not resolved" (the rounds overlap)."""
    if not ours or not theirs:
        raise ValueError("ratio_rounds needs at least one round of each")
    pairs = [a / b for a, b in zip(ours, theirs)]
    span = (min(ours) / max(theirs), max(ours) / min(theirs))
    verdict = "faster" if span[0] > 1 else "slower" if span[1] < 1 else "not resolved"
    return {"median": float(np.median(ours) / np.median(theirs)), "best": max(ours) / max(theirs),
            "paired": {"median": float(np.median(pairs)), "min": min(pairs), "max": max(pairs)},
            "span": list(span), "verdict": verdict}


def spread(rounds: list[float]) -> float:
    """The fastest round over the slowest, less one (0.25: the slowest took a quarter longer); 0 for one round."""
    return max(rounds) / min(rounds) - 1 if rounds else 0.0


def said_rounds(x: dict[str, Any]) -> str:
    """A ratio's rounds (``ratio_rounds``) in a few words: best rounds, the pairings' range, the verdict."""
    return f"best rounds {x['best']:.2f}x, any two rounds {x['span'][0]:.2f}-{x['span'][1]:.2f}x: {x['verdict']}"


# ---- nodes as run ------------------------------------------------------------------------------------------
COUNT = r"""
import json, os, sys, tempfile
import onnx, onnxruntime as ort
graph = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.optimized_model_filepath = os.path.join(tmp, "as-run.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "as-run.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(graph, so, providers=["CPUExecutionProvider"])
    ops = {}
    for node in onnx.load(so.optimized_model_filepath, load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
exported = len(onnx.load(graph, load_external_data=False).graph.node)
print(json.dumps({"exported": exported, "as_run": sum(ops.values()), "as_run_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])),
                  "onnxruntime": ort.__version__}))
"""


def count_nodes(py: Path | str, graph: Path) -> dict[str, Any]:
    """Nodes of ``graph`` as exported and as ONNX Runtime (CPU, all optimisations) runs it, in the ONNX Runtime of the Python
    ``py`` (the one that runs that graph), or {"status": "failed", ...}."""
    return measure_process([str(py), "-c", COUNT, str(graph)], f"counting the nodes of {graph.name}")


__all__ = ["COUNT", "EDGELIN_ROUND", "GENAI_ROUND", "TIMEOUT", "count_nodes", "edgelin_round_main", "figures", "measure_process", "ratio_rounds", "run_peak", "said_rounds", "spread"]
