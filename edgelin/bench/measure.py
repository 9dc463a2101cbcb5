"""What the sections measure beside their timings: the prefill worker (peak memory), copy bandwidth, the cost a
longer case is predicted to have, and a graph's node count and weight bytes.

Torch-free (numpy, onnxruntime and the runtime only): the prefill worker runs from this module in a
fresh process (``python -m edgelin.bench --worker SPEC``), so that its resident memory is the graph's
and not torch's. Nothing here may import torch, directly or through another edgelin module.

Peak memory of a prefill case: after the session is created and the inputs are allocated, the
kernel's high-water mark of resident memory is reset (``/proc/self/clear_refs``), the graph runs once,
and the new high-water mark (VmHWM) minus the resident size before the run is the run's peak increment
(activations, ORT's arena, outputs). Python's tracemalloc cannot see ORT's native allocations.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgelin.runtime.manifest import LOGITS_AT, StateSpec, positions_feed
from edgelin.runtime.providers import make_session_options, open_session

from .harness import proc_bytes, stats

INPUT_IDS = "input_ids"  # the graphs' token input (edgelin.exporters.graphs.INPUT_IDS, which imports torch)
SESSION_EXTRA = {"inter_op_num_threads": 1}  # with intra_op_num_threads = --threads: every thread count explicit


# ---- the machine's bandwidth, predictions, graph facts -----------------------------------------------
def copy_bandwidth(nbytes: int, repeats: int, rng: np.random.Generator) -> dict[str, Any]:
    """Single-thread memory bandwidth in GB/s: numpy copies of ``nbytes`` (bytes read + bytes written)."""
    src = rng.standard_normal(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm-up: pages faulted in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    bw = [2 * src.nbytes / t / 1e9 for t in times]
    return {"unit": "GB/s", "median": float(np.median(bw)), "p10": float(np.percentile(bw, 10)),
            "p90": float(np.percentile(bw, 90)), "max": float(max(bw)), "n": len(bw)}


def extrapolate(points: list[tuple[int, float]], T: int, power: int) -> float:
    """Predict a cost at length T from measured (length, cost) points, assuming cost = a + b * length**power.

    Two points fit a and b (a fixed overhead is not scaled up); one point scales proportionally (an
    over-estimate, on the safe side); none predicts 0.
    """
    if not points:
        return 0.0
    t2, c2 = points[-1]
    if len(points) == 1:
        return c2 * (T / t2) ** power
    t1, c1 = points[-2]
    slope = (c2 - c1) / (t2**power - t1**power)
    if slope <= 0:  # noise at small sizes: fall back to proportional scaling
        return c2 * (T / t2) ** power
    return c2 + slope * (T**power - t2**power)


def session_options(threads: int) -> ort.SessionOptions:
    """The options of every ONNX Runtime session the bench opens itself (the runtime's factory)."""
    return make_session_options(threads, extra=SESSION_EXTRA)


def node_counts(graph: Path, work: Path) -> dict[str, Any]:
    """Nodes of an ONNX file as exported, and as ONNX Runtime (CPU) runs it after its load-time fusions
    (e.g. an RMSNorm's six nodes become one SimplifiedLayerNormalization): per-node cost is what binds
    decode at small sizes, and the second count is the one that pays it."""
    import onnx

    loaded = work / f"{graph.stem}.as-run.onnx"
    ort.InferenceSession(str(graph), make_session_options(1, optimized_path=loaded), providers=["CPUExecutionProvider"])
    ops: dict[str, int] = {}
    for node in onnx.load(str(loaded), load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    loaded.unlink()  # its weights stay in the export's own file: ORT refers to them, it does not copy them
    exported = len(onnx.load(str(graph), load_external_data=False).graph.node)
    return {"exported": exported, "as_run": sum(ops.values()), "as_run_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}


def graph_weight_bytes(path: Path) -> int:
    """Bytes of a graph's initializers and Constant nodes."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    tensors = list(proto.graph.initializer)
    tensors += [a.t for node in proto.graph.node if node.op_type == "Constant" for a in node.attribute if a.name == "value"]
    return sum(int(np.prod(t.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize for t in tensors)


# ---- the prefill worker (one case per fresh, torch-free process) ---------------------------------
def run_worker(spec: dict[str, Any], threads: int, timeout: float) -> dict[str, Any]:
    """Run one prefill case in ``python -m edgelin.bench --worker SPEC``; {"status": "ok", ...} or
    {"status": "failed", "reason": ...}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        proc = subprocess.run([sys.executable, "-m", "edgelin.bench", "--worker", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        why = f"killed by signal {-proc.returncode} (out of memory?)" if proc.returncode < 0 else f"exit status {proc.returncode}"
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return {"status": "failed", "reason": f"worker {why}{': ' + tail if tail else ''}"}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["status"] = "ok"
    return result


def prefill_worker(graph: Path, states: list, *, provider: str, threads: int, vocab: int, T: int, seed: int, plan: Any,
                   piece: int | None = None) -> dict[str, Any]:
    """One batch-1 prefill of T tokens through ``graph`` (state specs ``states``, or none for a graph without state; in
    calls of ``piece`` tokens, the state carried, or one call) in a torch-free worker, within the plan's repeat budget
    and time cap: the worker's result (``worker_main``) with "status" ok, or a failure."""
    spec = {"graph": str(graph), "provider": provider, "threads": threads, "batch": 1, "T": T, "piece": piece, "vocab": vocab,
            "seed": seed, "budget_s": plan.case_budget_s, "min_repeats": plan.min_repeats,
            "max_repeats": plan.max_repeats, "states": [s.to_dict() for s in states]}
    return run_worker(spec, threads, timeout=plan.case_time_cap_s * (plan.max_repeats + 3) + 60)


def prefill_case(graph: Path, states: list, *, provider: str, threads: int, vocab: int, T: int, seed: int, plan: Any,
                 piece: int | None = None) -> dict[str, Any]:
    """``prefill_worker``'s figures: {"status": "ok", "seconds", "tokens_per_s", "peak_increment_bytes"} or a failure."""
    res = prefill_worker(graph, states, provider=provider, threads=threads, vocab=vocab, T=T, seed=seed, plan=plan, piece=piece)
    if res["status"] != "ok":
        return res
    sec = stats(res["times_s"], unit="s")
    return {"status": "ok", "seconds": sec, "tokens_per_s": T / sec["median"], "peak_increment_bytes": res["peak_increment_bytes"]}


def _rusage_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def worker_main(spec: dict[str, Any]) -> dict[str, Any]:
    """One prefill case: ``spec["T"]`` tokens (in pieces of ``spec["piece"]``, the state carried between
    them) through ``spec["graph"]``; returns the timings and the peak memory of the first run.

    ``spec["states"]`` lists the graph's state specs (``StateSpec.to_dict()``; none for a graph without
    state): each starts at its init value and each piece's ``output`` feeds the next piece's ``input``.
    """
    sess = open_session(spec["graph"], spec["provider"], options=session_options(spec["threads"]))
    B, T, piece = spec["batch"], spec["T"], spec["piece"] or spec["T"]
    rng = np.random.default_rng(spec["seed"])
    ids = rng.integers(0, spec["vocab"], (B, T), dtype=np.int64)
    specs = [StateSpec.from_dict(d, f"worker state {i}") for i, d in enumerate(spec.get("states", []))]
    fresh = {s.input: np.full(s.concrete_shape(B), s.init, dtype=s.np_dtype) for s in specs}
    names = [o.name for o in sess.get_outputs()]
    picks = any(i.name == LOGITS_AT for i in sess.get_inputs())  # the graph computes the logits it is asked for

    def run_once():
        state = fresh
        for start in range(0, T, piece):
            x = ids[:, start:start + piece]
            at = {LOGITS_AT: positions_feed(B, x.shape[1], last=True)} if picks else {}  # a prompt's next token, as a runtime asks
            outs = dict(zip(names, sess.run(None, {INPUT_IDS: x, **at, **state})))
            state = {s.input: outs[s.output] for s in specs}

    rss_before = proc_bytes("/proc/self/status", "VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident high-water mark (VmHWM) to the current RSS
        method = "VmHWM after clear_refs reset"
    except OSError:
        method = "ru_maxrss (lifetime peak; the increment is a lower bound)"
    if rss_before is None:
        rss_before = _rusage_peak()
    t0 = time.perf_counter()
    run_once()
    first = time.perf_counter() - t0
    peak = proc_bytes("/proc/self/status", "VmHWM") if method.startswith("VmHWM") else None
    if peak is None:
        peak = _rusage_peak()
    repeats = int(min(spec["max_repeats"], max(spec["min_repeats"], spec["budget_s"] // max(first, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "times_s": times, "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
            "peak_increment_bytes": max(0, peak - rss_before), "memory_method": method, "providers": sess.get_providers()}


__all__ = ["copy_bandwidth", "extrapolate", "graph_weight_bytes", "node_counts", "prefill_case", "prefill_worker", "run_worker",
           "session_options", "worker_main"]
