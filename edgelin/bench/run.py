"""``run_bench``: check the options, resolve the model, export and check the graphs, run the sections,
and write the report (JSON, plots)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from torch import nn

from edgelin.runtime.files import make_parents
from edgelin.threads import torch_threads

from . import baselines
from .decay import decay_section
from .foreign import fla_section
from .genai import genai_section
from .harness import machine_facts
from .hybrid import hybrid_section
from .llamacpp import llamacpp_section
from .lowering import lowering_section
from .plan import FULL, QUICK, SECTIONS, Progress, check_options, memory_cap, require_cuda, resolve_subject
from .plots import write_plots
from .precision import precision_section
from .report import DEFAULT_OUT, JSON_FILE, BenchReport, out_folder, record, write_json_atomic
from .sections import Bench
from .transformers_eager import transformers_section

OPT_IN = {"fla": fla_section, "decay": decay_section, "precision": precision_section, "llamacpp": llamacpp_section, "lowering": lowering_section,
          "hybrid": hybrid_section, "transformers": transformers_section, "genai": genai_section}  # opt-in section -> function(plan, threads, say) returning its part of the JSON
ON_SOURCE = ("precision",)  # opt-in sections that measure the source (and take source, provider, quick)

METHOD = {
    "timing": "median over repeated calls after warm-up, with p10/p90 and n; decode contenders are interleaved "
              "in rotating rounds in this one process, and ratios are of medians; prefill cases run one after another "
              "(all forms at one length back to back) in subprocesses of this same bench run",
    "memory": "each prefill case runs in a fresh torch-free subprocess: after session creation and input allocation "
              "the resident high-water mark is reset (/proc/self/clear_refs), the graph runs once, and "
              "VmHWM - VmRSS(before) is the run's peak increment (falls back to ru_maxrss where /proc is missing); "
              "tracemalloc cannot see ONNX Runtime's native allocations",
    "threads": "torch.set_num_threads and ORT intra_op_num_threads set to --threads; ORT inter_op_num_threads 1",
}


def run_bench(
    source: str | os.PathLike | nn.Module | None = None,
    *,
    provider: str = "cpu",
    threads: int = 1,
    quick: bool = False,
    out_dir: str | os.PathLike = DEFAULT_OUT,
    sections: tuple[str, ...] | list[str] | None = None,
    memory_cap_gb: float | None = None,
    plots: bool = True,
    progress: Progress | None = None,
    overwrite: bool = False,
    genai: dict[str, Any] | None = None,
) -> BenchReport:
    """Run the benchmark; write ``out_dir/bench.json`` (atomically) and PNG plots (if matplotlib is installed).

    source: a checkpoint folder, an export folder, a model that follows ``edgelin.protocol`` (put in
        eval mode; exported here), or None (the bundled model, else the documented default-size LinearLM
        with random weights: speed does not depend on weights). The softmax twin and the O(T^2) form are
        measured for a LinearLM only.
    provider: "cpu", "auto" or "cuda" for ONNX Runtime (PyTorch eager always runs on CPU).
    threads: torch and ONNX Runtime intra-op threads (set explicitly, and reported).
    quick: tiny lengths and few repeats (a smoke run for CI); numbers are not meaningful.
    sections: a subset of ALL_SECTIONS (default: SECTIONS, the model under test). Opt-in sections run only when
        named: "fla" builds a flash-linear-attention checkpoint and measures edgelin's import + export of it and
        decode against fla's own step (``edgelin.bench.foreign``; skipped, with the reason, without fla); "decay"
        compares same-size LinearLMs with each decay against the plain one (``edgelin.bench.decay``); "precision"
        exports the source (default: the bundled model) in fp32, fp16, int8 and int4 and measures size, decode,
        prefill and the weight-bytes floor of each (``edgelin.bench.precision``); "llamacpp" compares edgelin with
        llama.cpp on an LFM2 and a Mamba2 transformers checkpoint (``edgelin.bench.llamacpp``; skipped, with the
        reason, unless EDGELIN_LLAMA_CPP names a build of ``scripts/llamacpp_build.sh``); "lowering" exports three
        models with ``--ops portable`` and ``--ops fused`` and times both in the Python runtime, node and WASM
        (``edgelin.bench.lowering``); "hybrid" decodes linear, hybrid and softmax stacks of one size at 1k, 16k and
        64k positions (``edgelin.bench.hybrid``); "transformers" measures each Hugging Face family's export against
        transformers' own eager model (``edgelin.bench.transformers_eager``; skipped, with the reason, without transformers);
        "genai" measures edgelin's exports against onnxruntime-genai's builder on the same checkpoint (``edgelin.bench.genai``).
    memory_cap_gb: prefill cases predicted to need more are skipped (default: half the available memory).
    genai: the genai section's options (``genai.genai_section``'s keywords: checkpoint, models, precisions, thread_counts,
        rounds, ops, venv, cache_dir, on_model).
    overwrite: replace ``out_dir/bench.json`` and the plots even where they are not an earlier bench run's
        (recognised by content: the JSON's format key, the PNGs' Software text); checked before any work.
    """
    say = progress or (lambda _msg: None)
    source, sections = check_options(source, provider, threads, sections)
    cap = memory_cap(memory_cap_gb)
    out = out_folder(out_dir, overwrite)
    if provider == "cuda":  # say so now, not after a minute of exports
        require_cuda()

    plan = QUICK if quick else FULL
    own = tuple(s for s in sections if s in SECTIONS)  # sections measuring the model under test
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    model_entry: dict[str, Any] | None = None
    active, exports, verification = None, {}, None  # stay so when only opt-in sections run (they say their own provider)
    with torch_threads(threads):
        say(f"edgelin bench{' --quick' if quick else ''}: threads {threads}, provider {provider}, sections {', '.join(sections)}")
        machine = machine_facts()
        if own:
            subject = resolve_subject(source)
            say(f"model: {subject.label}")
            with tempfile.TemporaryDirectory(prefix="edgelin-bench-") as work:
                bench = Bench(subject, provider, threads, plan, Path(work), cap, say)
                bench.prepare(own)
                results = {name: getattr(bench, name)() for name in own}
                active = bench.active_provider
                state_bytes = bench.session.manifest.state_bytes(1)
                exports = {k: {"seconds": v["seconds"], "nodes": v["nodes"]} for k, v in bench.exports.items()}
                verification = baselines.verification_record(bench.checks)
                bench.session = None
            model_entry = {"label": subject.label, "random_weights": subject.random_weights, "config": subject.config(),
                           "parameters": subject.parameters(), "state_bytes_per_sequence": state_bytes,
                           "export": str(subject.export_dir) if subject.export_dir else "exported here"}
        for name in sections:
            if name in OPT_IN:
                context = {"source": source, "provider": provider, "quick": quick} if name in ON_SOURCE else {}
                if name == "genai":
                    context = dict(genai or {})
                results[name] = OPT_IN[name](plan, threads, say, **context)
    settings = {"threads": threads, "provider_requested": provider, "provider_active": active,
                "torch_threads": threads, "ort_intra_op_threads": threads, "ort_inter_op_threads": 1, "sections": list(sections)}
    # model is None when only opt-in sections ran (they describe their own models)
    data = record(results, machine=machine, settings=settings, quick=quick, model=model_entry, started=t_start,
                  method={**METHOD, "verification": verification}, exports=exports)
    report = BenchReport(data)
    make_parents(out)
    if plots:
        report.plots, data["plots"] = write_plots(data, out, overwrite=overwrite)
    else:
        data["plots"] = {"files": [], "skipped": "plots=False"}
    report.json_path = write_json_atomic(data, out / JSON_FILE, overwrite=overwrite)
    return report


__all__ = ["run_bench"]
