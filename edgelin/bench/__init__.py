"""Benchmarks: how fast and how small an export is, next to the baselines it replaces.

``run_bench(source, provider=..., threads=..., quick=...)`` measures six sections and returns a
``BenchReport`` (JSON + a printed table + optional PNG plots); ``edgelin bench`` is its command line.
Opt-in sections (``sections=["fla"]``, ``--section fla``) run only when named.

    plan        the sections, sizes and caps (FULL, QUICK), the checked options, the model under test
    harness     statistics, interleaved calls and alternating rounds, the machine and its load, other programs'
                output (commands, node scripts): what every section times with (torch-free)
    measure     the torch-free prefill worker (peak memory), copy bandwidth, predicted costs, graph facts
    baselines   the graphs exported here (softmax twin with a KV cache, O(T^2) form, chunk sweep) and
                their check against PyTorch (edgelin.parity budgets); the export workers
    gqa         the softmax twin's decode step around ORT's GroupQueryAttention, KV buffers updated in place
    checkpoints the Hugging Face checkpoints built with transformers' classes (llamacpp, transformers, scripts/)
    sections    decode, throughput, position, prefill, sweep, floor
    foreign     fla (opt-in): a flash-linear-attention checkpoint imported + exported, vs fla's own step
    decay       decay (opt-in): same-size LinearLMs with each decay vs the plain one
    precision   precision (opt-in): the model under test in fp32 / fp16 / int8 / int4
    llamacpp    llamacpp (opt-in): LFM2 and Mamba2 transformers checkpoints, edgelin vs llama.cpp (EDGELIN_LLAMA_CPP)
    lowering    lowering (opt-in): portable vs fused graphs (export --ops) in the Python runtime, node and WASM
    hybrid      hybrid (opt-in): linear, hybrid and softmax stacks of one size, decode and state against context
    transformers_eager  transformers (opt-in): each Hugging Face family's export vs transformers' eager model
    genai       genai (opt-in): edgelin vs onnxruntime-genai's builder (its own venv) on the same checkpoint
    goals       the speed goals judged on a record's figures
    report      BenchReport, the record (its envelope, the JSON file, the output folder), the table of every section
    plots       the PNG plots (matplotlib, optional)
    run         run_bench

Imports go one way: plan and harness at the bottom, then measure, baselines and the sections, then goals, plots
and report (which read records and import no section), then run. The report never imports a section.

Method (also written into the JSON):
- Threads are set explicitly: ``torch.set_num_threads(threads)`` and ORT ``intra_op_num_threads=threads``
  (``inter_op_num_threads=1``). On a small shared machine the default thread counts can make tiny ops
  ~100x slower.
- Every figure is a median over repeated calls after warm-up, with p10/p90 and the sample count. When
  two things are compared, their calls are interleaved in rounds within this one process run (A, B,
  C, then B, C, A, ...), so a change in machine load hits all of them alike; the ratio of medians is
  reported.
- Peak memory of a prefill case is measured in a fresh subprocess that imports only numpy and
  onnxruntime (``measure``). The baselines are exported here and each is checked against PyTorch
  once before it is timed.

Exports run first (in up to two worker processes), then the measurements, one at a time.

This package's ``__init__`` imports nothing: the prefill worker (``python -m edgelin.bench --worker
SPEC``) imports the package and must stay torch-free, so the public names below are loaded on first
use (PEP 562 ``__getattr__``); ``from edgelin.bench import run_bench`` works as for any module.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    # name: submodule that defines it
    "run_bench": "run",
    "BenchReport": "report", "format_table": "report", "write_json_atomic": "report", "_finite": "report",
    "FORMAT": "report", "JSON_FILE": "report", "DEFAULT_OUT": "report", "write_plots": "plots",
    "BenchError": "plan", "Plan": "plan", "FULL": "plan", "QUICK": "plan", "SECTIONS": "plan", "OPT_IN_SECTIONS": "plan",
    "ALL_SECTIONS": "plan", "PROVIDERS": "plan", "DEFAULT_MODEL": "plan", "Subject": "plan", "resolve_subject": "plan",
    "stats": "harness", "interleaved": "harness", "machine_facts": "harness",
}
_RENAMED = {"_cuda_is_active": ("plan", "cuda_is_active")}  # older private names still in use


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module, attr = _PUBLIC[name], name
    elif name in _RENAMED:
        module, attr = _RENAMED[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = ["ALL_SECTIONS", "BenchError", "BenchReport", "FULL", "OPT_IN_SECTIONS", "QUICK", "Plan", "SECTIONS", "format_table", "interleaved",
           "machine_facts", "run_bench", "stats"]
