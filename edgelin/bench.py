"""Benchmarks: how fast and how small is a LinearLM export, next to the baselines it replaces.

``run_bench(source, provider=..., threads=..., quick=...)`` measures five sections and returns a
``BenchReport`` (JSON + a printed table + optional PNG plots):

    decode    latency per token, batch 1 and 8: ORT decode graph (plain ``run`` and IO binding, through
              the runtime's Session) vs PyTorch eager ``LinearLM.step`` of the same model
    position  decode latency at positions 128 .. 16k (state carried: prefill to the position, then time
              decode steps) vs a same-size softmax transformer exported with a KV cache; memory per
              sequence (linear state bytes vs KV-cache bytes)
    prefill   throughput and peak memory vs prompt length: the chunked prefill graph, the quadratic
              masked form of the same model (form="parallel"), the softmax baseline, and the chunked
              graph fed in state-carried pieces; cases predicted to exceed a memory or time cap are
              skipped and say why
    sweep     prefill throughput vs the chunk size of the prefill graph (one export per chunk size)
    floor     memory bandwidth (numpy copy) and the decode graph's weight bytes: the lower bound per
              token, and measured / bound

Method (also written into the JSON):
- Threads are set explicitly: ``torch.set_num_threads(threads)`` and ORT ``intra_op_num_threads=threads``
  (``inter_op_num_threads=1``). On a small shared machine the default thread counts can make tiny ops
  ~100x slower.
- Every figure is a median over repeated calls after warm-up, with p10/p90 and the sample count. When
  two things are compared, their calls are interleaved in rounds within this one process run (A, B,
  C, then B, C, A, ...), so a change in machine load hits all of them alike; the ratio of medians is
  reported.
- Peak memory of a prefill case is measured in a fresh subprocess that imports only numpy and
  onnxruntime: after the session is created and the inputs are allocated, the kernel's high-water mark
  of resident memory is reset (``/proc/self/clear_refs``), the graph runs once, and the new high-water
  mark (VmHWM) minus the resident size before the run is the run's peak increment (activations, ORT's
  arena, outputs). Python's tracemalloc cannot see ORT's native allocations. The absolute peak RSS is
  reported too.
- The baselines are exported here and each is checked against PyTorch once before it is timed.

Exports run first (in up to two worker processes), then the measurements, one at a time.
This module imports neither torch nor onnxruntime at import time: its prefill worker
(``python -m edgelin.bench --worker SPEC``) must stay torch-free.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgelin import __version__
from edgelin.errors import EdgelinError
from edgelin.runtime.files import atomic_write, check_output_folder, make_parents

SECTIONS = ("decode", "position", "prefill", "sweep", "floor")
PROVIDERS = ("cpu", "auto", "cuda")
FORMAT = "edgelin-bench/1"
JSON_FILE = "bench.json"
DEFAULT_OUT = "bench-results"
VERIFY_BUDGET = 1e-4  # max abs logits error, ORT vs PyTorch, for every graph exported here
MAX_THREADS = 1024

# The documented default model when no checkpoint is given and none is bundled (speed does not depend on weights).
DEFAULT_MODEL = {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64}
MODEL_SEED, SOFTMAX_SEED, DATA_SEED = 0, 1, 2

Progress = Callable[[str], None]


class BenchError(EdgelinError):
    """A benchmark could not be set up (bad option, unusable model path, a baseline that failed its check)."""


@dataclass(frozen=True)
class Plan:
    """Sizes and repeat counts of one benchmark run (``FULL`` or ``QUICK``)."""

    decode_batches: tuple[int, ...]
    decode_warmup: int  # calls per contender before timing
    decode_rounds: int  # interleaved rounds ...
    decode_per_round: int  # ... of this many timed calls per contender
    positions: tuple[int, ...]
    position_warmup: int
    position_rounds: int
    position_per_round: int
    prefill_lengths: tuple[int, ...]
    piece: int  # piece length of the state-carried chunked prefill
    piece_from: int  # ... measured for T >= this
    case_budget_s: float  # timed seconds per prefill case (after its first run)
    min_repeats: int
    max_repeats: int
    case_time_cap_s: float  # skip a prefill case predicted to take longer than this per run
    sweep_length: int
    sweep_chunks: tuple[int, ...]  # the model's own chunk size is always added
    bandwidth_bytes: int
    bandwidth_repeats: int
    floor_calls: int


FULL = Plan(
    decode_batches=(1, 8), decode_warmup=20, decode_rounds=10, decode_per_round=30,
    positions=(128, 1024, 4096, 16384), position_warmup=5, position_rounds=5, position_per_round=10,
    prefill_lengths=(256, 1024, 4096, 16384, 65536), piece=4096, piece_from=16384,
    case_budget_s=3.0, min_repeats=3, max_repeats=20, case_time_cap_s=20.0,
    sweep_length=4096, sweep_chunks=(16, 32, 64, 128, 256),
    bandwidth_bytes=256 << 20, bandwidth_repeats=10, floor_calls=300,
)
QUICK = Plan(
    decode_batches=(1, 8), decode_warmup=3, decode_rounds=3, decode_per_round=8,
    positions=(32, 128), position_warmup=2, position_rounds=2, position_per_round=4,
    prefill_lengths=(64, 256), piece=64, piece_from=256,
    case_budget_s=0.2, min_repeats=2, max_repeats=5, case_time_cap_s=5.0,
    sweep_length=256, sweep_chunks=(32,),
    bandwidth_bytes=32 << 20, bandwidth_repeats=3, floor_calls=30,
)


# ---- statistics and timing ------------------------------------------------------------------------
def stats(seconds: list[float], unit: str = "ms") -> dict[str, Any]:
    """Median, p10, p90, min, max of samples given in seconds, converted to ``unit`` (ms or s)."""
    scale = {"ms": 1e3, "s": 1.0}[unit]
    a = np.asarray(seconds, dtype=np.float64) * scale
    p10, med, p90 = np.percentile(a, [10, 50, 90])
    return {"unit": unit, "median": float(med), "p10": float(p10), "p90": float(p90),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


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


def _ratio(a: dict, b: dict) -> float:
    return a["median"] / b["median"]


# ---- machine facts --------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _meminfo(key: str) -> int | None:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _caches() -> dict[str, str]:
    caches = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.is_dir() else []:
        level, kind, size = (_read(str(index / f)).strip() for f in ("level", "type", "size"))
        if level and size:
            caches[f"L{level}{'' if kind == 'Unified' else kind[0].lower()}"] = size
    return caches


def _cache_bytes(text: str) -> int | None:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip()
    try:
        return int(float(text[:-1]) * units[text[-1].upper()]) if text and text[-1].upper() in units else int(text)
    except ValueError:
        return None


def machine_facts() -> dict[str, Any]:
    """Cores, CPU model, caches, memory, load and library versions (no torch import needed)."""
    model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines() if line.startswith("model name")), platform.processor())
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    from importlib import metadata

    versions = {"python": platform.python_version(), "numpy": np.__version__, "edgelin": __version__}
    for name, dists in (("onnxruntime", ("onnxruntime-gpu", "onnxruntime")), ("torch", ("torch",)), ("onnx", ("onnx",)),
                        ("onnxscript", ("onnxscript",)), ("matplotlib", ("matplotlib",))):
        versions[name] = None
        for dist in dists:
            try:
                versions[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    try:
        import onnxruntime as ort

        ort_providers = ort.get_available_providers()
    except ImportError:
        ort_providers = []
    return {
        "cpu_model": model or "unknown", "cores": os.cpu_count(), "usable_cores": usable, "caches": _caches(),
        "memory_total_bytes": _meminfo("MemTotal"), "memory_available_bytes": _meminfo("MemAvailable"),
        "platform": platform.platform(), "versions": versions, "ort_available_providers": ort_providers,
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# ---- the model under test -------------------------------------------------------------------------
@dataclass
class Subject:
    """The LinearLM being measured, where its export comes from, and how to describe it."""

    model: Any  # LinearLM (eval, float32)
    label: str  # e.g. "random weights (default-size LinearLM, seed 0)"
    random_weights: bool
    export_dir: Path | None  # a given export, else None (exported here)
    opset: int


def _check_options(source, provider, threads, sections) -> tuple[Path | None, tuple[str, ...]]:
    if provider not in PROVIDERS:
        raise BenchError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise BenchError(f"threads must be an integer in 1..{MAX_THREADS}, got {threads!r}")
    sections = tuple(SECTIONS if not sections else sections)
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise BenchError(f"unknown section(s) {', '.join(map(repr, unknown))}; choose from {', '.join(SECTIONS)}")
    sections = tuple(s for s in SECTIONS if s in sections)  # canonical order, no duplicates
    if source is None:
        return None, sections
    path = Path(source)
    if not path.exists():
        raise BenchError(f"{path} does not exist; pass a checkpoint folder (config.json + model.safetensors) or an export folder (edgelin.json)")
    if not path.is_dir():
        raise BenchError(f"{path} is not a folder; pass a checkpoint folder (config.json + model.safetensors) or an export folder (edgelin.json)")
    from edgelin.runtime.manifest import MANIFEST_FILE

    if not (path / MANIFEST_FILE).is_file() and not (path / "config.json").is_file():
        raise BenchError(f"{path} is neither a checkpoint folder (config.json + model.safetensors) nor an export folder (edgelin.json)")
    return path, sections


def resolve_subject(path: Path | None) -> Subject:
    """The model to measure: an export folder, a checkpoint folder, the bundled model, or the default random model."""
    import torch

    from edgelin.checkpoint import load_checkpoint
    from edgelin.config import ModelConfig
    from edgelin.exporters.exporter import DEFAULT_OPSET
    from edgelin.model import LinearLM
    from edgelin.runtime.manifest import MANIFEST_FILE, Manifest

    def random_model(cfg: ModelConfig) -> LinearLM:
        torch.manual_seed(MODEL_SEED)
        return LinearLM(cfg).float().eval()

    if path is not None and (path / MANIFEST_FILE).is_file():
        manifest = Manifest.load(path)
        cfg = ModelConfig.from_dict(manifest.model)
        return Subject(random_model(cfg), f"export {path} (ORT rows run its graphs; PyTorch and baseline rows use random weights of its config)",
                       True, path, int(manifest.opset))
    if path is None:
        from edgelin.models import bundled_checkpoint

        path = bundled_checkpoint()
        if path is None:
            cfg = ModelConfig(**DEFAULT_MODEL)
            return Subject(random_model(cfg), f"random weights (default-size LinearLM {_describe(cfg)}, seed {MODEL_SEED}; speed does not depend on weights)",
                           True, None, DEFAULT_OPSET)
        return Subject(load_checkpoint(path).float().eval(), f"bundled checkpoint {path.name}", False, None, DEFAULT_OPSET)
    return Subject(load_checkpoint(path).float().eval(), f"checkpoint {path}", False, None, DEFAULT_OPSET)


def _describe(cfg) -> str:
    return f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads x {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.feature_map}, chunk {cfg.chunk_size}"


# ---- exporting the graphs -------------------------------------------------------------------------
def _graph_modules():
    """Torch wrappers for the graphs exported here (defined lazily: this module must import without torch)."""
    import torch
    from torch import nn

    class SoftmaxPrefill(nn.Module):
        """input_ids [B, T] -> logits [B, T, V], present.{i}.k/v [B, H, T, Dh] (the KV cache)."""

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: torch.Tensor):
            logits, cache = self.model(input_ids, None)
            return (logits, *cache.values())

    class SoftmaxDecode(nn.Module):
        """input_ids [B, 1], past.{i}.k/v [B, H, P, Dh] -> logits [B, 1, V], present.{i}.k/v [B, H, P + 1, Dh]."""

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model
            self.keys = _kv_keys(model.cfg.n_layers)

        def forward(self, input_ids: torch.Tensor, *past: torch.Tensor):
            logits, cache = self.model(input_ids, dict(zip(self.keys, past)))
            return (logits, *(cache[k] for k in self.keys))

    return SoftmaxPrefill, SoftmaxDecode


def _kv_keys(n_layers: int) -> list[str]:
    return [f"{i}.{n}" for i in range(n_layers) for n in ("k", "v")]


EXPORT_COST = {"linear": 3, "parallel": 2, "chunk": 2, "softmax_prefill": 1, "softmax_decode": 1}  # rough relative export times


def _export_job(job: dict) -> dict:
    """Export one graph (in an export worker process). Returns {"seconds": ..., "nodes": ...}."""
    import onnx
    import torch

    from edgelin.config import ModelConfig
    from edgelin.exporters.exporter import export_graph, export
    from edgelin.exporters.graphs import INPUT_IDS, LOGITS, graph_spec
    from edgelin.model import LinearLM
    from edgelin.softmax import SoftmaxLM

    cfg = ModelConfig.from_dict(job["config"])
    kind, path, opset = job["kind"], Path(job["path"]), job["opset"]
    cls = SoftmaxLM if kind.startswith("softmax") else LinearLM
    model = cls(cfg)
    with np.load(job["weights"]) as weights:
        model.load_state_dict({k: torch.from_numpy(weights[k]) for k in weights.files})
    model = model.float().eval()
    t0 = time.perf_counter()
    if kind == "linear":
        result = export(model, path, opset=opset, force=True, check=True)
        return {"seconds": time.perf_counter() - t0, "nodes": result.nodes}

    SoftmaxPrefill, SoftmaxDecode = _graph_modules()
    batch = torch.export.Dim("batch", min=1, max=1 << 16)
    sequence = torch.export.Dim("sequence", min=1, max=1 << 24)
    if kind in ("parallel", "chunk"):
        if kind == "chunk":
            model = model.with_chunk_size(job["chunk"]).eval()
        spec = graph_spec(model, "prefill", form="parallel" if kind == "parallel" else None)  # the quadratic form, or chunked
        export_graph(spec.module, spec.example, (spec.input_names, spec.output_names), spec.dynamic_shapes, opset, path)
    elif kind == "softmax_prefill":
        keys = _kv_keys(cfg.n_layers)
        names = ([INPUT_IDS], [LOGITS] + [f"present.{k}" for k in keys])
        example = (torch.zeros(2, 37, dtype=torch.int64),)
        export_graph(SoftmaxPrefill(model), example, names, ({0: batch, 1: sequence},), opset, path)
    elif kind == "softmax_decode":
        keys = _kv_keys(cfg.n_layers)
        past_len = torch.export.Dim("past", min=1, max=1 << 24)
        names = ([INPUT_IDS] + [f"past.{k}" for k in keys], [LOGITS] + [f"present.{k}" for k in keys])
        past = [torch.zeros(2, cfg.n_heads, 11, cfg.head_dim) for _ in keys]
        example = (torch.zeros(2, 1, dtype=torch.int64), *past)
        dynamic = ({0: batch}, tuple({0: batch, 2: past_len} for _ in keys))
        export_graph(SoftmaxDecode(model), example, names, dynamic, opset, path)
    else:  # pragma: no cover -- internal
        raise ValueError(f"unknown export job {kind!r}")
    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    return {"seconds": time.perf_counter() - t0, "nodes": {kind: nodes}}


def _export_worker_main(jobs_file: str) -> None:
    """Run a list of export jobs in this process (torch.onnx's warm-up is paid once per worker)."""
    import torch

    torch.set_num_threads(1)
    jobs = json.loads(Path(jobs_file).read_text(encoding="utf-8"))
    results = {job["name"]: _export_job(job) for job in jobs}
    write_json_atomic(results, Path(jobs_file).with_suffix(".result.json"))


def _run_exports(jobs: list[dict], work: Path, say: Progress) -> dict[str, dict]:
    """Run the export jobs in up to two worker processes (``python -m edgelin.bench --export``), balanced by cost.

    Plain subprocesses, not multiprocessing: a caller's script is never re-imported.
    """
    if not jobs:
        return {}
    n = min(2, os.cpu_count() or 1, len(jobs))
    groups: list[list[dict]] = [[] for _ in range(n)]
    for job in sorted(jobs, key=lambda j: -EXPORT_COST[j["kind"]]):  # longest first, onto the least-loaded worker
        min(groups, key=lambda g: sum(EXPORT_COST[j["kind"]] for j in g)).append(job)
    say(f"exporting {len(jobs)} graph job(s) ({', '.join(j['name'] for j in jobs)}) in {n} process(es); ~10 s per graph ...")
    t0 = time.perf_counter()
    procs = []
    for i, group in enumerate(groups):
        jobs_file = work / f"export-jobs-{i}.json"
        jobs_file.write_text(json.dumps(group), encoding="utf-8")
        log = open(work / f"export-jobs-{i}.log", "w+", encoding="utf-8")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs.append((jobs_file, log, subprocess.Popen([sys.executable, "-m", "edgelin.bench", "--export", str(jobs_file)],
                                                       stdout=log, stderr=subprocess.STDOUT, env=env)))
    results, failures = {}, []
    try:
        for jobs_file, log, proc in procs:
            code = proc.wait()
            if code == 0:
                results.update(json.loads(jobs_file.with_suffix(".result.json").read_text(encoding="utf-8")))
            else:
                log.seek(0)
                lines = [line.strip() for line in log.read().splitlines() if line.strip()]
                failures.append((lines or [f"exit status {code}"])[-1][:300])
    finally:
        for _, log, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failures:
        raise BenchError(f"exporting the benchmark graphs failed: {failures[0]}")
    say(f"  exports done in {time.perf_counter() - t0:.1f} s")
    return results


# ---- ONNX Runtime helpers -------------------------------------------------------------------------
def _session_options(threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return so


def _ep_list(provider: str) -> list:
    return ["CUDAExecutionProvider", "CPUExecutionProvider"] if provider == "cuda" else ["CPUExecutionProvider"]


def _raw_session(path: Path, provider: str, threads: int):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), _session_options(threads), providers=_ep_list(provider))
    if provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        raise BenchError(f"CUDA is not active for {path.name} (ONNX Runtime fell back to CPU); use --provider cpu")
    return sess


def _cuda_is_active() -> bool:
    """Whether ONNX Runtime really runs a (one-node) graph on CUDA here: onnxruntime-gpu lists CUDA even without a GPU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    ort.set_default_logger_severity(4)  # ORT logs a multi-line error when the CUDA libraries are missing
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return sess.get_providers()[0] == "CUDAExecutionProvider"
    except Exception:  # noqa: BLE001 -- any failure means: not usable
        return False
    finally:
        ort.set_default_logger_severity(2)


def _max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


# ---- the benchmark --------------------------------------------------------------------------------
@dataclass
class BenchReport:
    data: dict[str, Any]
    json_path: Path | None = None
    plots: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def table(self) -> str:
        return format_table(self.data)


class _Bench:
    def __init__(self, subject: Subject, provider: str, threads: int, plan: Plan, work: Path, memory_cap: int, say: Progress) -> None:
        self.subject, self.provider, self.threads, self.plan, self.work, self.say = subject, provider, threads, plan, work, say
        self.model = subject.model
        self.cfg = subject.model.cfg
        self.memory_cap = memory_cap
        self.rng = np.random.default_rng(DATA_SEED)
        self.paths: dict[str, Path] = {}
        self.exports: dict[str, dict] = {}
        self.checks: dict[str, float] = {}
        self.softmax = None
        self.session = None  # the runtime Session of the linear export
        self.active_provider = None

    # ---- set-up --------------------------------------------------------------------------------
    def prepare(self, sections: tuple[str, ...]) -> None:
        import torch

        from edgelin.softmax import SoftmaxLM

        torch.manual_seed(SOFTMAX_SEED)
        self.softmax = SoftmaxLM(self.cfg).float().eval()
        weights, sm_weights = str(self.work / "linear-weights.npz"), str(self.work / "softmax-weights.npz")
        np.savez(weights, **{k: v.detach().numpy() for k, v in self.model.state_dict().items()})
        np.savez(sm_weights, **{k: v.detach().numpy() for k, v in self.softmax.state_dict().items()})
        base = {"config": self.cfg.to_dict(), "opset": self.subject.opset}
        jobs = []
        if self.subject.export_dir is None:
            jobs.append({**base, "name": "linear", "kind": "linear", "weights": weights, "path": str(self.work / "linear")})
            self.paths["linear"] = self.work / "linear"
        else:
            self.paths["linear"] = self.subject.export_dir
        if "position" in sections:
            jobs.append({**base, "name": "softmax_decode", "kind": "softmax_decode", "weights": sm_weights, "path": str(self.work / "softmax_decode.onnx")})
        if "prefill" in sections:
            jobs.append({**base, "name": "softmax_prefill", "kind": "softmax_prefill", "weights": sm_weights, "path": str(self.work / "softmax_prefill.onnx")})
            jobs.append({**base, "name": "parallel", "kind": "parallel", "weights": weights, "path": str(self.work / "parallel.onnx")})
        if "sweep" in sections:
            for c in self.sweep_chunks():
                if c != self.cfg.chunk_size:
                    jobs.append({**base, "name": f"chunk{c}", "kind": "chunk", "chunk": c, "weights": weights, "path": str(self.work / f"chunk{c}.onnx")})
        self.exports = _run_exports(jobs, self.work, self.say)
        for job in jobs:
            if job["name"] != "linear":
                self.paths[job["name"]] = Path(job["path"])
        self.open_session()
        self.verify()

    def sweep_chunks(self) -> list[int]:
        return sorted(set(self.plan.sweep_chunks) | {self.cfg.chunk_size})

    def open_session(self) -> None:
        import warnings

        from edgelin.runtime.session import Session

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.session = Session(self.paths["linear"], self.provider, self.threads, session_options={"inter_op_num_threads": 1})
        for w in caught:
            self.say(f"note: {w.message}")
        self.active_provider = self.session.provider

    def verify(self) -> None:
        """Each graph exported here vs PyTorch once, on CPU, before anything is timed."""
        import torch

        self.say("checking the baseline graphs against PyTorch ...")
        gen = torch.Generator().manual_seed(DATA_SEED)
        V = self.cfg.vocab_size
        with torch.inference_mode():
            if "softmax_decode" in self.paths or "softmax_prefill" in self.paths:
                ids = torch.randint(0, V, (2, 37), generator=gen)
                ref, cache = self.softmax(ids)
                if "softmax_prefill" in self.paths:
                    got = _raw_session(self.paths["softmax_prefill"], "cpu", self.threads).run(None, {"input_ids": ids.numpy()})
                    self.checks["softmax_prefill"] = max([_max_abs(got[0], ref)] + [_max_abs(g, c) for g, c in zip(got[1:], cache.values())])
                if "softmax_decode" in self.paths:
                    sess = _raw_session(self.paths["softmax_decode"], "cpu", self.threads)
                    worst = 0.0
                    for past in (1, 37):  # the dynamic past length at its smallest and at another value
                        kv = {k: v[:, :, :past] for k, v in cache.items()}
                        tok = torch.randint(0, V, (2, 1), generator=gen)
                        ref2, cache2 = self.softmax(tok, kv)
                        got = sess.run(None, {"input_ids": tok.numpy(), **{f"past.{k}": v.numpy() for k, v in kv.items()}})
                        worst = max([worst, _max_abs(got[0], ref2)] + [_max_abs(g, c) for g, c in zip(got[1:], cache2.values())])
                    self.checks["softmax_decode"] = worst
            linear_graphs = [n for n in self.paths if n == "parallel" or n.startswith("chunk")]
            for name in linear_graphs:
                model = self.model if name == "parallel" else self.model.with_chunk_size(int(name[5:])).eval()
                sess = _raw_session(self.paths[name], "cpu", self.threads)
                worst = 0.0
                for T in sorted({1, model.cfg.chunk_size + 1, 2 * model.cfg.chunk_size + 3}):
                    ids = torch.randint(0, V, (2, T), generator=gen)
                    state = self.model.init_state(2)
                    ref, ref_state = self.model(ids, state)  # the chunked form: every form must give the same
                    feeds = {"input_ids": ids.numpy(), **{f"state.{k}": v.numpy() for k, v in state.items()}}
                    got = sess.run(None, feeds)
                    worst = max([worst, _max_abs(got[0], ref)] + [_max_abs(g, r) / max(1.0, float(r.abs().max())) for g, r in zip(got[1:], ref_state.values())])
                self.checks[name] = worst
        bad = {k: v for k, v in self.checks.items() if not v <= VERIFY_BUDGET}
        if bad:
            raise BenchError("a baseline graph disagrees with PyTorch: " + ", ".join(f"{k} max error {v:.2e}" for k, v in bad.items())
                             + f" > {VERIFY_BUDGET:.0e}; nothing was timed")
        self.say("  " + ", ".join(f"{k} {v:.1e}" for k, v in self.checks.items()) + f" (budget {VERIFY_BUDGET:.0e}): ok")

    # ---- 1. decode latency -----------------------------------------------------------------------
    def decode(self) -> dict[str, Any]:
        import torch

        p, sess = self.plan, self.session
        out: dict[str, Any] = {"what": "ms per decode call (one token per sequence); tokens/s = batch / median",
                               "contenders": {"torch_eager": "LinearLM.step, PyTorch eager (CPU), inference_mode",
                                              "ort_run": "runtime Session.decode, io_binding=False (InferenceSession.run, numpy feeds)",
                                              "ort_iobinding": "runtime Session.decode, io_binding=True (state buffers reused)"},
                               "batches": {}}
        for B in p.decode_batches:
            self.say(f"decode: batch {B} (torch eager vs ORT run vs ORT IO binding) ...")
            ids_np = self.rng.integers(0, self.cfg.vocab_size, (B, 1), dtype=np.int64)
            ids_t = torch.from_numpy(ids_np)
            holder = {"torch": self.model.init_state(B), "run": sess.new_state(B), "bind": sess.new_state(B)}

            def eager():
                holder["torch"] = self.model.step(ids_t, holder["torch"])[1]

            def ort_run():
                sess.io_binding = False
                sess.decode(ids_np, holder["run"])

            def ort_bind():
                sess.io_binding = True
                sess.decode(ids_np, holder["bind"])

            with torch.inference_mode():
                samples = interleaved({"torch_eager": eager, "ort_run": ort_run, "ort_iobinding": ort_bind},
                                      warmup=p.decode_warmup, rounds=p.decode_rounds, per_round=p.decode_per_round)
            sess.io_binding = True
            row = {name: stats(s) for name, s in samples.items()}
            for name in samples:
                row[name]["tokens_per_s"] = B / (row[name]["median"] / 1e3)
            row["ratios"] = {
                "torch_eager_over_ort_run": _ratio(row["torch_eager"], row["ort_run"]),
                "torch_eager_over_ort_iobinding": _ratio(row["torch_eager"], row["ort_iobinding"]),
                "ort_run_over_ort_iobinding": _ratio(row["ort_run"], row["ort_iobinding"]),
            }
            out["batches"][str(B)] = row
        return out

    # ---- 2. decode vs position -------------------------------------------------------------------
    def position(self) -> dict[str, Any]:
        import onnxruntime as ort

        p, sess, cfg = self.plan, self.session, self.cfg
        soft = _raw_session(self.paths["softmax_decode"], self.provider, self.threads)
        device = ("cuda", 0) if self.active_provider == "cuda" else ("cpu", 0)
        keys = _kv_keys(cfg.n_layers)
        state_bytes = sess.manifest.state_bytes(1)
        steps = p.position_warmup + p.position_rounds * p.position_per_round
        rows = []
        for P in p.positions:
            self.say(f"position {P:,}: prefill, then decode steps (linear state vs softmax KV cache) ...")
            state = sess.new_state(1)
            sess.io_binding = True
            sess.prefill(self.rng.integers(0, cfg.vocab_size, (1, P), dtype=np.int64), state, chunk=self.plan.piece, last_only=True)
            tok = self.rng.integers(0, cfg.vocab_size, (1, 1), dtype=np.int64)
            # the softmax cache: values do not change its speed, its length does; filled with random values
            kv = {"past": [ort.OrtValue.ortvalue_from_numpy(self.rng.standard_normal((1, cfg.n_heads, P, cfg.head_dim), dtype=np.float32), *device) for _ in keys]}

            def linear():
                sess.decode(tok, state)

            def softmax():
                io = soft.io_binding()
                io.bind_cpu_input("input_ids", tok)
                for k, v in zip(keys, kv["past"]):
                    io.bind_ortvalue_input(f"past.{k}", v)
                io.bind_output("logits", *device)
                for k in keys:
                    io.bind_output(f"present.{k}", *device)
                soft.run_with_iobinding(io)
                kv["past"] = io.get_outputs()[1:]  # the cache grows by one position: fed back as the next past

            samples = interleaved({"linear": linear, "softmax": softmax}, warmup=p.position_warmup,
                                  rounds=p.position_rounds, per_round=p.position_per_round)
            lin, sm = stats(samples["linear"]), stats(samples["softmax"])
            kv_bytes = cfg.kv_cache_bytes(P)
            rows.append({
                "position": P, "linear_ms": lin, "softmax_kv_ms": sm, "softmax_over_linear": _ratio(sm, lin),
                "linear_state_bytes": state_bytes, "kv_cache_bytes": kv_bytes, "kv_over_state": kv_bytes / state_bytes,
            })
        return {
            "what": f"ms per decode step at batch 1 after P tokens; both carry their state/cache over the {steps} steps timed",
            "softmax_baseline": "SoftmaxLM (same widths, RoPE, random weights) decode step exported here with past k/v of dynamic length; "
                                "present k/v fed back through IO binding; its cache starts from random values of length P",
            "memory_per_sequence": "linear state bytes (constant) vs fp32 KV-cache bytes 2 * layers * heads * P * head_dim * 4",
            "rows": rows,
        }

    # ---- 3. prefill and 3b. chunk sweep (each case in a subprocess) ------------------------------
    def _worker(self, graph: Path, T: int, piece: int | None) -> dict[str, Any]:
        p = self.plan
        spec = {"graph": str(graph), "provider": self.active_provider, "threads": self.threads, "batch": 1, "T": T, "piece": piece,
                "vocab": self.cfg.vocab_size, "seed": DATA_SEED, "budget_s": p.case_budget_s,
                "min_repeats": p.min_repeats, "max_repeats": p.max_repeats}
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        timeout = p.case_time_cap_s * (p.max_repeats + 3) + 60
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

    def _case(self, form: str, graph: Path, T: int, piece: int | None, history: dict, quadratic: bool) -> dict[str, Any]:
        """One prefill case, unless it is predicted to exceed the memory or time cap (then skipped, with why)."""
        row: dict[str, Any] = {"form": form, "T": T}
        if piece:
            row["piece"] = piece
        if history.get("skipped_at"):
            return {**row, "status": "skipped", "reason": f"a shorter length ({history['skipped_at']:,}) was already skipped"}
        power = 2 if quadratic else 1
        analytic = 2 * self.cfg.n_heads * T * T * 4 if quadratic else 0  # two live [B, H, T, T] fp32 tensors
        seen = history.setdefault("seen", [])  # (T, peak increment, median seconds) of the cases measured so far
        pred_mem = max(analytic, _extrapolate([(t, m) for t, m, _ in seen], T, power))
        pred_s = _extrapolate([(t, sec) for t, _, sec in seen], T, power)
        reason = None
        if pred_mem > self.memory_cap:
            reason = f"predicted peak {_mb(pred_mem)} > memory cap {_mb(self.memory_cap)}"
        elif pred_s > self.plan.case_time_cap_s:
            reason = f"predicted {pred_s:.0f} s per run > time cap {self.plan.case_time_cap_s:.0f} s"
        if reason:
            history["skipped_at"] = T
            return {**row, "status": "skipped", "reason": reason}
        self.say(f"  {form:13s} T={T:>6,}{f' in pieces of {piece:,}' if piece else ''} ...")
        res = self._worker(graph, T, piece)
        if res["status"] != "ok":
            history["skipped_at"] = T
            return {**row, **res}
        sec = stats(res["times_s"], unit="s")
        seen.append((T, res["peak_increment_bytes"], sec["median"]))
        return {**row, "status": "ok", "seconds": sec, "tokens_per_s": T / sec["median"], "first_run_s": res["first_s"],
                "peak_rss_bytes": res["peak_rss_bytes"], "peak_increment_bytes": res["peak_increment_bytes"],
                "rss_before_bytes": res["rss_before_bytes"], "memory_method": res["memory_method"], "providers": res["providers"]}

    def prefill(self) -> dict[str, Any]:
        p = self.plan
        linear = self.paths["linear"] / self.session.manifest.graphs["prefill"]
        forms = [("chunk", linear, None, False), ("parallel", self.paths["parallel"], None, True),
                 ("softmax", self.paths["softmax_prefill"], None, True), ("chunk_pieces", linear, p.piece, False)]
        rows = []
        histories: dict[str, dict] = {form: {} for form, *_ in forms}
        for T in p.prefill_lengths:  # length-major: the forms compared at one length run back to back
            self.say(f"prefill: T={T:,} ...")
            for form, graph, piece, quadratic in forms:
                if form == "chunk_pieces" and T < p.piece_from:
                    continue
                rows.append(self._case(form, graph, T, piece, histories[form], quadratic))
        ok = {(r["form"], r["T"]): r for r in rows if r["status"] == "ok"}
        ratios = []
        for T in p.prefill_lengths:
            chunk = ok.get(("chunk", T))
            if chunk is None:
                continue
            entry: dict[str, Any] = {"T": T}
            for other, key in (("parallel", "chunk_over_parallel"), ("softmax", "chunk_over_softmax")):
                if (other, T) in ok:
                    entry[key] = chunk["tokens_per_s"] / ok[(other, T)]["tokens_per_s"]
            if ("chunk_pieces", T) in ok:
                entry["pieces_over_chunk"] = ok[("chunk_pieces", T)]["tokens_per_s"] / chunk["tokens_per_s"]
            ratios.append(entry)
        return {
            "what": "seconds per prefill of T tokens at batch 1 (the whole prompt in one graph run, unless in pieces); "
                    "tokens/s = T / median; ratios are of tokens/s",
            "forms": {"chunk": "the export's prefill graph (chunked parallel form, O(T) memory)",
                      "parallel": "the same LinearLM exported with form='parallel' (quadratic masked form, O(T^2) memory)",
                      "softmax": "SoftmaxLM of the same size (random weights) exported here, causal softmax over all T",
                      "chunk_pieces": f"the export's prefill graph fed {p.piece:,}-token pieces, state carried between runs"},
            "lengths": list(p.prefill_lengths), "memory_cap_bytes": self.memory_cap, "time_cap_s": p.case_time_cap_s,
            "rows": rows, "ratios": ratios,
            "skipped": [f"{r['form']} T={r['T']}: {r['reason']}" for r in rows if r["status"] != "ok"],
        }

    def sweep(self) -> dict[str, Any]:
        T = self.plan.sweep_length
        self.say(f"chunk sweep at T={T:,} ...")
        linear = self.paths["linear"] / self.session.manifest.graphs["prefill"]
        rows = []
        for c in self.sweep_chunks():
            graph = linear if c == self.cfg.chunk_size else self.paths[f"chunk{c}"]
            row = self._case("chunk", graph, T, None, {}, False)
            rows.append({"chunk": c, "export_seconds": self.exports.get(f"chunk{c}", {}).get("seconds"), **row})
        ok = [r for r in rows if r["status"] == "ok"]
        best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        for r in ok:
            r["over_best"] = r["tokens_per_s"] / best["tokens_per_s"]
        return {"what": f"prefill of T={T:,} tokens, batch 1, one graph per chunk size (re-exported)", "length": T,
                "model_chunk": self.cfg.chunk_size, "best_chunk": best["chunk"] if best else None, "rows": rows}

    # ---- 4. the floor ----------------------------------------------------------------------------
    def floor(self) -> dict[str, Any]:
        import onnx

        p, sess = self.plan, self.session
        self.say("floor: memory bandwidth (numpy copy) and decode weight bytes ...")
        n = p.bandwidth_bytes // 4
        src = self.rng.standard_normal(n, dtype=np.float32)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # warm-up: pages faulted in
        times = []
        for _ in range(p.bandwidth_repeats):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        bw = [2 * src.nbytes / t / 1e9 for t in times]  # bytes read + bytes written
        bandwidth = {"unit": "GB/s", "median": float(np.median(bw)), "p10": float(np.percentile(bw, 10)),
                     "p90": float(np.percentile(bw, 90)), "max": float(max(bw)), "n": len(bw)}
        del src, dst
        proto = onnx.load(str(self.paths["linear"] / sess.manifest.graphs["decode"]), load_external_data=False)
        weight_bytes = sum(_tensor_bytes(t) for t in proto.graph.initializer)
        weight_bytes += sum(_tensor_bytes(a.t) for node in proto.graph.node if node.op_type == "Constant" for a in node.attribute if a.name == "value")
        state_bytes = sess.manifest.state_bytes(1)
        measured = {}
        for B in (1, 8):
            state = sess.new_state(B)
            ids = self.rng.integers(0, self.cfg.vocab_size, (B, 1), dtype=np.int64)
            sess.io_binding = True
            samples = interleaved({"ort_iobinding": lambda: sess.decode(ids, state)}, warmup=10, rounds=1, per_round=p.floor_calls)
            measured[B] = stats(samples["ort_iobinding"])
        GBps = bandwidth["max"] * 1e9  # the best copy seen: the lowest floor
        rows = {}
        for B, m in measured.items():
            moved = weight_bytes + 2 * B * state_bytes  # weights read once per call; the state read and written
            floor_ms = moved / GBps * 1e3
            rows[str(B)] = {"bytes_per_call": moved, "floor_ms_per_call": floor_ms, "floor_ms_per_token": floor_ms / B,
                            "weights_only_floor_ms_per_token": weight_bytes / GBps * 1e3 / B,
                            "measured_ms_per_call": m, "measured_ms_per_token": m["median"] / B,
                            "measured_over_floor": m["median"] / floor_ms}
        llc = max((_cache_bytes(v) or 0 for k, v in _caches().items() if k[1:].isdigit()), default=0)
        return {
            "what": "lower bound per decode call = (decode-graph weight bytes + 2 x batch x state bytes) / memory bandwidth "
                    "(weights_only_floor: weight bytes alone); bandwidth = best single-thread numpy copy of copy_bytes, "
                    "counting bytes read + bytes written; measured = ORT decode with IO binding, timed here",
            "bandwidth_GBps": bandwidth, "copy_bytes": int(p.bandwidth_bytes), "weight_bytes": int(weight_bytes),
            "state_bytes_per_sequence": int(state_bytes), "last_level_cache_bytes": int(llc) or None,
            "weights_fit_in_cache": bool(llc and weight_bytes + 2 * state_bytes < llc),
            "batches": rows,
        }


def _extrapolate(points: list[tuple[int, float]], T: int, power: int) -> float:
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


def _tensor_bytes(t) -> int:
    import onnx

    return int(np.prod(t.dims, dtype=np.int64)) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


# ---- the public entry point -----------------------------------------------------------------------
def run_bench(
    source: str | os.PathLike | None = None,
    *,
    provider: str = "cpu",
    threads: int = 1,
    quick: bool = False,
    out_dir: str | os.PathLike = DEFAULT_OUT,
    sections: tuple[str, ...] | list[str] | None = None,
    memory_cap_gb: float | None = None,
    plots: bool = True,
    progress: Progress | None = None,
) -> BenchReport:
    """Run the benchmark; write ``out_dir/bench.json`` (atomically) and PNG plots (if matplotlib is installed).

    source: a checkpoint folder, an export folder, or None (the bundled model, else the documented
        default-size LinearLM with random weights: speed does not depend on weights).
    provider: "cpu", "auto" or "cuda" for ONNX Runtime (PyTorch eager always runs on CPU).
    threads: torch and ONNX Runtime intra-op threads (set explicitly, and reported).
    quick: tiny lengths and few repeats (a smoke run for CI); numbers are not meaningful.
    sections: a subset of SECTIONS (default all).
    memory_cap_gb: prefill cases predicted to need more are skipped (default: half the available memory).
    """
    say = progress or (lambda _msg: None)
    path, sections = _check_options(source, provider, threads, sections)
    if memory_cap_gb is not None and not (isinstance(memory_cap_gb, (int, float)) and memory_cap_gb > 0 and math.isfinite(memory_cap_gb)):
        raise BenchError(f"memory cap must be a positive number of GB, got {memory_cap_gb!r}")
    out = Path(out_dir)
    check_output_folder(out)  # checked now, created only when there is something to write: a failed run leaves no folder
    if provider == "cuda" and not _cuda_is_active():  # say so now, not after a minute of exports
        raise BenchError("CUDA was requested but ONNX Runtime cannot activate CUDAExecutionProvider here "
                         "(no usable GPU, or CUDA/cuDNN libraries missing); use --provider cpu")

    import torch

    plan = QUICK if quick else FULL
    t_start = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    available = _meminfo("MemAvailable") or (8 << 30) * 2
    cap = int(memory_cap_gb * 1e9) if memory_cap_gb is not None else int(available // 2)
    try:
        say(f"edgelin bench{' --quick' if quick else ''}: threads {threads}, provider {provider}, sections {', '.join(sections)}")
        machine = machine_facts()
        subject = resolve_subject(path)
        say(f"model: {subject.label}")
        with tempfile.TemporaryDirectory(prefix="edgelin-bench-") as work:
            bench = _Bench(subject, provider, threads, plan, Path(work), cap, say)
            bench.prepare(sections)
            results = {name: getattr(bench, name)() for name in sections}
            active = bench.active_provider
            state_bytes = bench.session.manifest.state_bytes(1)
            exports = {k: {"seconds": v["seconds"], "nodes": v["nodes"]} for k, v in bench.exports.items()}
            checks = dict(bench.checks)
            bench.session = None
    finally:
        torch.set_num_threads(before)
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    cfg = subject.model.cfg
    data = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": bool(quick),
        "settings": {"threads": threads, "provider_requested": provider, "provider_active": active,
                     "torch_threads": threads, "ort_intra_op_threads": threads, "ort_inter_op_threads": 1, "sections": list(sections)},
        "machine": machine,
        "busy": _busy(machine),
        "model": {"label": subject.label, "random_weights": subject.random_weights, "config": cfg.to_dict(),
                  "parameters": subject.model.num_parameters(), "state_bytes_per_sequence": state_bytes,
                  "export": str(subject.export_dir) if subject.export_dir else "exported here"},
        "method": {
            "timing": "median over repeated calls after warm-up, with p10/p90 and n; decode contenders are interleaved "
                      "in rotating rounds in this one process, and ratios are of medians; prefill cases run one after another "
                      "(all forms at one length back to back) in subprocesses of this same bench run",
            "memory": "each prefill case runs in a fresh torch-free subprocess: after session creation and input allocation "
                      "the resident high-water mark is reset (/proc/self/clear_refs), the graph runs once, and "
                      "VmHWM - VmRSS(before) is the run's peak increment (falls back to ru_maxrss where /proc is missing); "
                      "tracemalloc cannot see ONNX Runtime's native allocations",
            "threads": "torch.set_num_threads and ORT intra_op_num_threads set to --threads; ORT inter_op_num_threads 1",
            "verification": {"budget_max_abs": VERIFY_BUDGET, "max_abs_error": checks},
        },
        "exports": exports,
        **results,
        "seconds": time.perf_counter() - t_start,
    }
    report = BenchReport(data)
    make_parents(out)
    if plots:
        report.plots, data["plots"] = write_plots(data, out)
    else:
        data["plots"] = {"files": [], "skipped": "plots=False"}
    report.json_path = write_json_atomic(data, out / JSON_FILE)
    return report


def _busy(machine: dict) -> dict[str, Any]:
    load = machine.get("load_average_start") or [0.0]
    cores = machine.get("usable_cores") or 1
    return {"load_1min_start": load[0], "cores": cores, "busy": load[0] > 0.5 * cores,
            "note": "numbers from a busy machine are not representative" if load[0] > 0.5 * cores else ""}


def _finite(x: Any) -> Any:
    """JSON has no NaN or infinity: such a value (never expected) becomes null rather than a crash after the run."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def write_json_atomic(data: dict, path: Path) -> Path:
    """Write JSON atomically (edgelin.runtime.files.atomic_write); non-finite numbers become null."""
    data = _finite(data)
    text = json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))
    return path


# ---- plots (optional: matplotlib is the `plots` extra) --------------------------------------------
def write_plots(data: dict, out: Path) -> tuple[list[Path], dict[str, Any]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return [], {"files": [], "skipped": "matplotlib is not installed (pip install 'edgelin[plots]')"}
    files = []
    import textwrap

    title = "\n".join(textwrap.wrap(data["model"]["label"], 110)[:2])
    title += f"\n{data['machine']['cpu_model']}, threads {data['settings']['threads']}, {data['settings']['provider_active']}"
    if data.get("quick") or data["busy"]["busy"]:
        title += "  [" + ", ".join(x for x in ("QUICK" if data.get("quick") else "", "BUSY MACHINE" if data["busy"]["busy"] else "") if x) + "]"

    def save(fig, name):
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        try:
            files.append(atomic_write(out / name, lambda f: fig.savefig(f, format="png", dpi=120)))
        finally:
            plt.close(fig)

    def err(s):  # asymmetric error bars p10..p90 around the median
        return [[s["median"] - s["p10"]], [s["p90"] - s["median"]]]

    def log_ticks(ax, values):  # label the measured lengths themselves: 128, 1k, 16k, 64k
        ax.set_xticks(values, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())

    if "decode" in data:
        fig, ax = plt.subplots(figsize=(7, 4))
        batches = list(data["decode"]["batches"])
        names = ["torch_eager", "ort_run", "ort_iobinding"]
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            for i, B in enumerate(batches):
                s = data["decode"]["batches"][B][name]
                ax.bar(i + j * width, s["median"] / int(B), width, yerr=np.array(err(s)) / int(B), capsize=3,
                       color=f"C{j}", label=name if i == 0 else None)
        ax.set_xticks([i + width for i in range(len(batches))], [f"batch {B}" for B in batches])
        ax.set_ylabel("ms per token (median, p10-p90)")
        ax.set_title("decode latency per token")
        ax.legend()
        save(fig, "decode.png")
    if "position" in data:
        rows = data["position"]["rows"]
        P = [r["position"] for r in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for key, label, c in (("linear_ms", "linear (state)", "C0"), ("softmax_kv_ms", "softmax (KV cache)", "C1")):
            med = [r[key]["median"] for r in rows]
            a1.plot(P, med, "o-", color=c, label=label)
            a1.fill_between(P, [r[key]["p10"] for r in rows], [r[key]["p90"] for r in rows], color=c, alpha=0.2)
        a1.set_xscale("log")
        a1.set_yscale("log")
        log_ticks(a1, P)
        a1.set_xlabel("position (tokens already seen)")
        a1.set_ylabel("ms per decode step")
        a1.set_title("decode latency vs position")
        a1.legend()
        a2.plot(P, [r["linear_state_bytes"] / 1e6 for r in rows], "o-", label="linear state")
        a2.plot(P, [r["kv_cache_bytes"] / 1e6 for r in rows], "o-", label="softmax KV cache")
        a2.set_xscale("log")
        a2.set_yscale("log")
        log_ticks(a2, P)
        a2.set_xlabel("position")
        a2.set_ylabel("MB per sequence (fp32)")
        a2.set_title("memory per sequence")
        a2.legend()
        save(fig, "position.png")
    if "prefill" in data:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for i, form in enumerate(data["prefill"]["forms"]):
            ok = [r for r in data["prefill"]["rows"] if r["form"] == form and r["status"] == "ok"]
            if not ok:
                continue
            T = [r["T"] for r in ok]
            a1.errorbar(T, [r["tokens_per_s"] for r in ok], fmt="o-", color=f"C{i}", label=form,
                        yerr=[[r["tokens_per_s"] - r["T"] / r["seconds"]["p90"] for r in ok], [r["T"] / r["seconds"]["p10"] - r["tokens_per_s"] for r in ok]])
            a2.plot(T, [r["peak_increment_bytes"] / 1e6 for r in ok], "o-", color=f"C{i}", label=form)
        skipped = data["prefill"]["skipped"]
        for a in (a1, a2):
            a.set_xscale("log")
            a.set_yscale("log")
            log_ticks(a, list(data["prefill"]["lengths"]))
            a.set_xlabel("prompt length T")
            a.legend(fontsize=7)
        a1.set_ylabel("tokens/s (median, p10-p90)")
        a1.set_title("prefill throughput")
        a2.set_ylabel("peak memory increment, MB")
        a2.set_title("prefill peak memory (subprocess VmHWM)")
        if skipped:
            a2.text(0.01, 0.99, "skipped:\n" + "\n".join(skipped)[:600], transform=a2.transAxes, fontsize=5, va="top")
        save(fig, "prefill.png")
    if "sweep" in data:
        ok = [r for r in data["sweep"]["rows"] if r["status"] == "ok"]
        if ok:
            fig, a1 = plt.subplots(figsize=(6, 4))
            C = [r["chunk"] for r in ok]
            a1.plot(C, [r["tokens_per_s"] for r in ok], "o-", color="C0")
            a1.set_xscale("log", base=2)
            log_ticks(a1, C)
            a1.set_xlabel("chunk size")
            a1.set_ylabel("prefill tokens/s", color="C0")
            a2 = a1.twinx()
            a2.plot(C, [r["peak_increment_bytes"] / 1e6 for r in ok], "s--", color="C1")
            a2.set_ylabel("peak memory increment, MB", color="C1")
            a1.set_title(f"chunk size sweep at T={data['sweep']['length']:,}")
            save(fig, "sweep.png")
    if "floor" in data:
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = data["floor"]["batches"]
        labels = list(rows)
        ax.bar([i - 0.2 for i in range(len(labels))], [rows[b]["floor_ms_per_token"] for b in labels], 0.4, label="floor (bytes / bandwidth)")
        ax.bar([i + 0.2 for i in range(len(labels))], [rows[b]["measured_ms_per_token"] for b in labels], 0.4, label="measured (ORT IO binding)")
        ax.set_xticks(range(len(labels)), [f"batch {b}" for b in labels])
        ax.set_ylabel("ms per token")
        ax.set_title(f"decode floor at {data['floor']['bandwidth_GBps']['max']:.1f} GB/s copy bandwidth")
        ax.legend()
        save(fig, "floor.png")
    return files, {"files": [p.name for p in files], "skipped": None}


# ---- the printed table ----------------------------------------------------------------------------
def _ms(s: dict) -> str:
    return f"{s['median']:8.3f} [{s['p10']:.3f}-{s['p90']:.3f}]"


def _mb(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:,.2f} GB"
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def format_table(d: dict) -> str:
    m, s = d["machine"], d["settings"]
    v = m["versions"]
    lines = [
        f"edgelin bench{' --quick (smoke run: sizes too small to mean anything)' if d['quick'] else ''}",
        f"machine: {m['cpu_model']}, {m['usable_cores']} usable core(s) of {m['cores']}, caches {', '.join(f'{k} {x}' for k, x in m['caches'].items()) or 'n/a'}, "
        f"memory {(m['memory_total_bytes'] or 0) / 2**30:.1f} GiB",
        f"software: onnxruntime {v['onnxruntime']}, torch {v['torch']}, numpy {v['numpy']}, onnx {v['onnx']}, python {v['python']}",
        f"settings: threads {s['threads']} (torch and ORT intra-op), provider {s['provider_requested']} -> active {s['provider_active']}",
        f"model: {d['model']['label']}; {d['model']['parameters']:,} parameters; state {d['model']['state_bytes_per_sequence']:,} bytes per sequence",
        f"load average at start {d['busy']['load_1min_start']:.2f} on {d['busy']['cores']} core(s)"
        + (": BUSY machine, numbers are not representative" if d["busy"]["busy"] else ""),
        "figures: median [p10-p90] over repeated calls after warm-up; decode contenders interleaved in one process, "
        "prefill forms run back to back per length, all in this one bench run",
    ]
    if "decode" in d:
        lines += ["", "1. decode latency per call (ms), median [p10-p90]"]
        for B, row in d["decode"]["batches"].items():
            for name in ("torch_eager", "ort_run", "ort_iobinding"):
                lines.append(f"  batch {B:>2}  {name:14s} {_ms(row[name])}  {row[name]['tokens_per_s']:>10,.0f} tok/s")
            r = row["ratios"]
            lines.append(f"            eager / ORT run {r['torch_eager_over_ort_run']:.2f}x, eager / ORT binding {r['torch_eager_over_ort_iobinding']:.2f}x, "
                         f"run / binding {r['ort_run_over_ort_iobinding']:.2f}x")
    if "position" in d:
        lines += ["", "2. decode at position P (ms per step) and memory per sequence",
                  f"  {'P':>7}  {'linear':>26}  {'softmax + KV cache':>26}  {'sm/lin':>6}  {'state':>10}  {'KV cache':>10}"]
        for r in d["position"]["rows"]:
            lines.append(f"  {r['position']:>7,}  {_ms(r['linear_ms']):>26}  {_ms(r['softmax_kv_ms']):>26}  {r['softmax_over_linear']:5.2f}x  "
                         f"{_mb(r['linear_state_bytes']):>10}  {_mb(r['kv_cache_bytes']):>10}")
    if "prefill" in d:
        p = d["prefill"]
        lines += ["", f"3. prefill, batch 1: tokens/s and peak memory increment (memory cap {_mb(p['memory_cap_bytes'])}, time cap {p['time_cap_s']:.0f} s per run)"]
        for r in p["rows"]:
            name = r["form"] + (f"/{r['piece']}" if r.get("piece") else "")
            if r["status"] == "ok":
                lines.append(f"  {name:18s} T={r['T']:>6,}  {r['tokens_per_s']:>12,.0f} tok/s  [{r['T'] / r['seconds']['p90']:,.0f}-{r['T'] / r['seconds']['p10']:,.0f}]  "
                             f"n={r['seconds']['n']:<2}  peak +{_mb(r['peak_increment_bytes'])} (RSS {_mb(r['peak_rss_bytes'])})")
            else:
                lines.append(f"  {name:18s} T={r['T']:>6,}  {r['status']}: {r['reason']}")
        for r in p["ratios"]:
            parts = [f"{k} {x:.2f}x" for k, x in r.items() if k != "T"]
            if parts:
                lines.append(f"  T={r['T']:>6,}: " + ", ".join(parts))
    if "sweep" in d:
        w = d["sweep"]
        lines += ["", f"3b. chunk size sweep, prefill T={w['length']:,} (model's chunk {w['model_chunk']}, best {w['best_chunk']})"]
        for r in w["rows"]:
            if r["status"] == "ok":
                lines.append(f"  chunk {r['chunk']:>4}  {r['tokens_per_s']:>12,.0f} tok/s  ({r['over_best']:.2f} of best)  peak +{_mb(r['peak_increment_bytes'])}")
            else:
                lines.append(f"  chunk {r['chunk']:>4}  {r['status']}: {r['reason']}")
    if "floor" in d:
        f = d["floor"]
        bw = f["bandwidth_GBps"]
        lines += ["", f"4. floor: copy bandwidth {bw['median']:.1f} GB/s median, {bw['max']:.1f} best; decode weights {_mb(f['weight_bytes'])}, "
                      f"state {_mb(f['state_bytes_per_sequence'])} per sequence"]
        for B, r in f["batches"].items():
            lines.append(f"  batch {B:>2}: floor {r['floor_ms_per_token']:.4f} ms/token (weights alone {r['weights_only_floor_ms_per_token']:.4f}), "
                         f"measured {r['measured_ms_per_token']:.4f} ms/token "
                         f"-> measured / floor {r['measured_over_floor']:.1f}x")
        if f["weights_fit_in_cache"]:
            lines.append(f"  note: weights + state fit in the last-level cache ({_mb(f['last_level_cache_bytes'])}): the DRAM floor is not binding")
    plots = d.get("plots") or {}
    lines += ["", f"plots: {', '.join(plots.get('files') or []) or 'skipped (' + str(plots.get('skipped')) + ')'}",
              f"total {d['seconds']:.1f} s"]
    return "\n".join(lines)


# ---- the prefill worker (torch-free; one case per process) ----------------------------------------
def _status_kb(key: str) -> int | None:
    for line in _read("/proc/self/status").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _worker_main(spec: dict) -> dict:
    import resource

    sess = _raw_session(Path(spec["graph"]), spec["provider"], spec["threads"])
    B, T, piece = spec["batch"], spec["T"], spec["piece"] or spec["T"]
    rng = np.random.default_rng(spec["seed"])
    ids = rng.integers(0, spec["vocab"], (B, T), dtype=np.int64)
    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(float16)": np.float16}
    states = {a.name: np.zeros([B if isinstance(d, str) or d is None else d for d in a.shape], dtype=dtypes[a.type])
              for a in sess.get_inputs() if a.name != "input_ids"}
    out_names = [o.name for o in sess.get_outputs()]

    def run_once():
        feeds_state = dict(states)
        for start in range(0, T, piece):
            outs = sess.run(None, {"input_ids": ids[:, start:start + piece], **feeds_state})
            feeds_state = {"state." + n[len("present."):]: o for n, o in zip(out_names, outs) if n.startswith("present.") and "state." + n[len("present."):] in states}

    rss_before = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident high-water mark (VmHWM) to the current RSS
        method = "VmHWM after clear_refs reset"
    except OSError:
        method = "ru_maxrss (lifetime peak; the increment is a lower bound)"
    if rss_before is None:
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    t0 = time.perf_counter()
    run_once()
    first = time.perf_counter() - t0
    peak = _status_kb("VmHWM") if method.startswith("VmHWM") else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    repeats = int(min(spec["max_repeats"], max(spec["min_repeats"], spec["budget_s"] // max(first, 1e-9))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - t0)
    return {"first_s": first, "times_s": times, "rss_before_bytes": rss_before, "peak_rss_bytes": peak,
            "peak_increment_bytes": max(0, peak - rss_before), "memory_method": method, "providers": sess.get_providers()}


if __name__ == "__main__":  # internal workers: python -m edgelin.bench --worker '{...}' | --export JOBS.json
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(_worker_main(json.loads(sys.argv[2]))))
    elif len(sys.argv) == 3 and sys.argv[1] == "--export":
        _export_worker_main(sys.argv[2])
    else:
        sys.exit("usage: python -m edgelin.bench --worker SPEC_JSON | --export JOBS_JSON (internal; use `edgelin bench`)")


__all__ = ["BenchError", "BenchReport", "FULL", "QUICK", "Plan", "SECTIONS", "format_table", "interleaved",
           "machine_facts", "run_bench", "stats"]
