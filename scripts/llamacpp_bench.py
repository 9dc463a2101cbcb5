"""edgelin vs llama.cpp on the same checkpoints: the bench's opt-in ``llamacpp`` section, its record kept.

    bash scripts/llamacpp_build.sh /opt/llama        # once: llama.cpp from the llama-cpp-python sdist (minutes)
    EDGELIN_LLAMA_CPP=/opt/llama/llama.cpp python scripts/llamacpp_bench.py [--quick] [--out docs/bench/llamacpp.json]
    EDGELIN_LLAMA_CPP=... python scripts/llamacpp_bench.py --model lfm2-350m --precisions fp32,int8 --rounds 2 \
        --out docs/bench/llamacpp-lfm2-350m.json     # a published configuration at real size (scripts/real_size.py)

Runs ``edgelin bench --section llamacpp`` (edgelin/bench/llamacpp.py: an LFM2 and a Mamba2 transformers checkpoint,
GGUF F32/F16/Q8_0/Q4_0 vs edgelin fp32/fp16/int8/int4, threads 1 and 2, decode and prefill tokens/s in alternating
rounds, edgelin in the Python runtime, in node and in onnxruntime-web's WASM backend, greedy ids vs transformers),
prints its table and writes the bench record (atomically) to --out (node and wasm need node and ``npm ci`` in this
checkout; where they cannot run, the record says so). Fails, with the reason, where the section was skipped: a
record of nothing is not kept.

With ``--model NAME`` the section runs instead on one random-init checkpoint of a published configuration (the
models of scripts/real_size.py that transformers builds, e.g. LFM2-350M: 354 M parameters, vocabulary 65,536), with
a byte-level tokenizer of that vocabulary; ``--precisions``, ``--threads``, ``--rounds``, ``--lengths``, ``--decode``
and ``--runtimes`` narrow the run (a 350 M model's 4k prefill takes tens of seconds per engine and round).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from edgelin.bench import run_bench
from edgelin.bench.llamacpp import PRECISIONS, RUNTIMES, VARIANTS, llamacpp_section
from edgelin.bench.plan import FULL
from edgelin.bench.harness import machine_facts
from edgelin.bench.report import BenchReport, record
from edgelin.errors import EdgelinError
from edgelin.runtime.files import write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/bench/llamacpp.json", help="where the record goes [%(default)s]")
    ap.add_argument("--quick", action="store_true", help="one round, short lengths: a smoke run; numbers mean little")
    ap.add_argument("--model", help="a published configuration of scripts/real_size.py, at real size, instead of the section's two small models")
    ap.add_argument("--precisions", help=f"comma-separated, of {','.join([*PRECISIONS, *VARIANTS])} [{','.join(PRECISIONS)}]")
    ap.add_argument("--threads", help="comma-separated thread counts [1,2]")
    ap.add_argument("--rounds", type=int, help=f"alternating rounds [{FULL.llama_rounds}]")
    ap.add_argument("--lengths", help=f"prefill lengths [{','.join(map(str, FULL.llama_lengths))}]")
    ap.add_argument("--decode", type=int, help=f"decode calls per measurement [{FULL.llama_decode}]")
    ap.add_argument("--runtimes", help=f"comma-separated edgelin runtimes, of {','.join(RUNTIMES)} [all]")
    args = ap.parse_args()
    runtimes = tuple(args.runtimes.split(",")) if args.runtimes else RUNTIMES  # checked by the section before any work
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.model is None and any(v is not None for v in (args.precisions, args.threads, args.rounds, args.lengths, args.decode, args.runtimes)):
        sys.exit("--precisions, --threads, --rounds, --lengths, --decode and --runtimes go with --model; the section's own run is fixed")
    try:
        if args.model is None:
            with tempfile.TemporaryDirectory(prefix="edgelin-llamacpp-") as tmp:
                report = run_bench(sections=["llamacpp"], quick=args.quick, out_dir=tmp, plots=False, progress=say)
        else:
            report = _published(args, say, runtimes)
    except EdgelinError as exc:  # an unknown runtime, an export that could not be written (a full disk): one line
        sys.exit(f"llamacpp bench: {exc}; nothing written")
    part = report.data["llamacpp"]
    if part["status"] != "ok":
        print(report.table())
        sys.exit(f"llamacpp section {part['status']}: {part.get('reason', '')}; nothing written")
    written = write_json(Path(args.out), report.data)  # before the table: a run of many minutes is kept whatever follows
    print(report.table())
    print(f"wrote {written}")


def _published(args: argparse.Namespace, say, runtimes: tuple[str, ...]) -> BenchReport:
    """The section on one published configuration of scripts/real_size.py (transformers-built models only)."""
    import dataclasses

    from real_size import FLA_MODEL_TYPES, MODELS  # this folder's real-size script: the published configurations

    if args.model not in MODELS or MODELS[args.model][0] in FLA_MODEL_TYPES:
        sys.exit(f"--model: one of {', '.join(k for k, (t, _) in MODELS.items() if t not in FLA_MODEL_TYPES)} "
                 "(llama.cpp converts transformers checkpoints)")
    precisions = tuple(args.precisions.split(",")) if args.precisions else None
    unknown = sorted(set(precisions or ()) - set(PRECISIONS) - set(VARIANTS))
    if unknown:
        sys.exit(f"--precisions: unknown {', '.join(unknown)}; use {','.join([*PRECISIONS, *VARIANTS])}")
    plan = FULL
    if args.rounds:
        plan = dataclasses.replace(plan, llama_rounds=args.rounds)
    if args.lengths:
        plan = dataclasses.replace(plan, llama_lengths=tuple(int(x) for x in args.lengths.split(",")))
    if args.decode:
        plan = dataclasses.replace(plan, llama_decode=args.decode)
    threads = tuple(int(x) for x in args.threads.split(",")) if args.threads else None
    machine, t0 = machine_facts(), time.perf_counter()
    part = llamacpp_section(plan, max(threads or (1,)), say, models={args.model: MODELS[args.model]}, precisions=precisions,
                            thread_counts=threads, runtimes=runtimes)
    settings = {"threads": max(threads or (1,)), "provider_requested": "cpu", "provider_active": "CPUExecutionProvider"}
    # the goals: against llama.cpp at the largest thread count run, the worst row
    return BenchReport(record({"llamacpp": part}, machine=machine, settings=settings, quick=False, model=None, started=t0,
                              published_model=args.model))


if __name__ == "__main__":
    main()
