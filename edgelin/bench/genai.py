"""The ``genai`` section: edgelin against onnxruntime-genai, the ONNX peer, on the same transformers checkpoint.

Opt-in (``edgelin bench --section genai``). For each model of the plan's ``genai_models`` (``MODELS``: LFM2-350M and
Qwen3.5-0.8B with their published configurations, random weights, built by transformers' own classes; or the folder
given as ``checkpoint``):

    genai      onnxruntime-genai's builder (``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p P -e cpu``), run
               offline from the local folder in its own virtual environment (``VENV_PACKAGES``; a folder the user names, or
               ``DIR/venv`` made on first use under the cache folder DIR, ``default_dir``), at fp32, int8 and int4
    edgelin    ``edgelin export`` of the same folder at the same precision (int4 also with ``--embedding int4``, genai's
               4-bit embedding table: equal weight bytes), once per lowering of ``OPS`` (``--ops portable`` and ``--ops fused``)
    llama.cpp  the folder as GGUF (F32, Q8_0, Q4_0; ``edgelin.bench.llamacpp``) where ``EDGELIN_LLAMA_CPP`` names a build;
               llama-bench's repacked path crashes on some CPUs (AMX): the crash is detected and the run repeated with
               repacking off, and the record says which path ran

then, per precision and thread count, ``genai_rounds`` rounds in which every contender runs once, each in its own
process, the order reversed every other round (``harness.round_order``): edgelin, genai, ..., genai, edgelin. One process
loads its model, warms up (one prompt and a few decode steps), then times one prefill call of ``genai_prompt`` tokens
(prefill tokens/s) and ``genai_decode`` greedy steps after it (decode: the median step; genai's ``generate_next_token``,
edgelin's argmax + ``Session.decode``). Recorded: the medians over rounds, edgelin / genai, the weight bytes of every
export's files, the decode nodes per layer as ONNX Runtime runs each graph (after its load-time fusions), and the greedy
ids of each export against genai's at the same precision (same model, so they should agree at fp32).

Built checkpoints, genai's builds and edgelin's exports are kept in the cache folder and reused while what made them is
unchanged (the checkpoint, the builder's version, edgelin's code and the export options: ``stamp``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .checkpoints import PUBLISHED, build_checkpoint
from .genai_cache import (
    ENV_DIR, STAMP, VENV_PACKAGES, code_fingerprint, default_dir, ensure_venv, folder_fingerprint, fresh, last_line, stamp_it, stamped,
    venv_python,
)
from .genai_rounds import GENAI_ROUND, TIMEOUT, count_nodes, figures, measure_process, ratio_rounds, run_peak, said_rounds, spread
from .harness import load_average, round_order
from .plan import DATA_SEED, BenchError, Plan, Progress

GENAI_PRECISION = {"fp32": "fp32", "int8": "int8", "int4": "int4", "int4-table4": "int4"}  # edgelin precision -> genai builder -p
EXPORT_OPTIONS = {"fp32": {"precision": "fp32"}, "int8": {"precision": "int8"}, "int4": {"precision": "int4"},
                  "int4-table4": {"precision": "int4", "embedding": "int4"}}  # edgelin's export options per precision name
DESCRIBE = {"int4": "int4 (edgelin's 8-bit embedding table)", "int4-table4": "int4, 4-bit embedding table (--embedding int4)"}
OPS = ("portable", "fused")
GGUF = {"fp32": "F32", "int8": "Q8_0", "int4": "Q4_0"}  # edgelin precision -> the GGUF type llama.cpp runs beside it
# Qwen3.5 as its released checkpoints are (Qwen3_5ForConditionalGeneration, the text model nested beside a vision config):
# genai's builder reads only that form. A one-block vision tower keeps the folder small; both tools leave it out.
_TINY_VISION = {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 1024}
# with the released config's multimodal rotary sections (text positions: the same in every section, plain RoPE for edgelin):
# without them genai's graph takes 3-D position ids its RotaryEmbedding refuses
_QWEN_TEXT = {**PUBLISHED["qwen3.5-0.8b"][1], "rope_parameters": {**PUBLISHED["qwen3.5-0.8b"][1]["rope_parameters"],
                                                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
MODELS: dict[str, tuple[str, dict[str, Any], str]] = {  # name -> (model_type, config, transformers Auto class)
    "lfm2-350m": (*PUBLISHED["lfm2-350m"], "AutoModelForCausalLM"),
    "qwen3.5-0.8b": ("qwen3_5", {"text_config": _QWEN_TEXT, "vision_config": _TINY_VISION, "tie_word_embeddings": True},
                     "AutoModelForImageTextToText"),
    "lfm2-tiny": ("lfm2", {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "conv", "full_attention", "conv"],
                           "tie_word_embeddings": True}, "AutoModelForCausalLM"),  # the quick plan's; tied, as LFM2's published
    # checkpoints are: genai 0.18's builder reads an untied LFM2's logits off the embedding table (its logits then differ)
}
WARMUP_STEPS = 8


# ---- building and exporting ---------------------------------------------------------------------------
def checkpoint_for(name: str, cache: Path, say: Progress, build: Callable[..., Path] = build_checkpoint) -> Path:
    """Model ``name`` of MODELS with random weights in ``cache/name/checkpoint`` (built by transformers in a subprocess,
    reused while its stamp matches)."""
    model_type, config, auto = MODELS[name]
    folder = cache / name / "checkpoint"
    stamp = {"model_type": model_type, "config": config, "auto_class": auto}
    if stamped(folder, stamp):
        return folder
    say(f"genai: {name}: building the checkpoint with transformers (its configuration of MODELS, random weights) in {folder} ...")
    build(name, fresh(folder), {name: (model_type, config)}, auto_class=auto)
    stamp_it(folder, stamp)
    return folder


def builder_command(py: Path, ckpt: Path, out: Path, precision: str, cache: Path) -> list[str]:
    return [str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out), "-p", GENAI_PRECISION[precision],
            "-e", "cpu", "-c", str(cache)]


def genai_build(py: Path, versions: dict[str, str], ckpt: Path, out: Path, precision: str, say: Progress) -> dict[str, Any] | None:
    """genai's builder on ``ckpt`` at ``precision`` into ``out``, offline (HF_HUB_OFFLINE); its output to ``out``'s log.
    {"builder_s", "peak_rss_bytes"}, or None where an earlier build with the same stamp was reused. BenchError, one line,
    if it fails."""
    stamp = {"checkpoint": str(ckpt), "checkpoint_fingerprint": folder_fingerprint(ckpt), "precision": GENAI_PRECISION[precision],
             "onnxruntime_genai": versions["onnxruntime_genai"]}
    if stamped(out, stamp):
        return None
    fresh(out)
    log = out.parent / f"{out.name}.log"
    cmd = builder_command(py, ckpt, out, precision, out.parent / f"{out.name}-cache")
    say(f"genai: builder -p {GENAI_PRECISION[precision]} on {ckpt} -> {out} (log {log}) ...")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    code, stdout, stderr, peak = run_peak(cmd, env=env)
    log.write_text(stdout + stderr)
    if code != 0 or not (out / "genai_config.json").is_file():
        why = f"ran past {TIMEOUT:.0f} s" if code is None else f"killed by signal {-code}" + (
            f" (peak resident memory {peak / 1e9:.1f} GB: the machine's memory ran out?)" if code == -9 else "") if code < 0 else last_line(log)
        raise BenchError(f"onnxruntime-genai's builder failed at {GENAI_PRECISION[precision]} on {ckpt}: {why}; its whole output: {log}")
    shutil.rmtree(out.parent / f"{out.name}-cache", ignore_errors=True)
    stamp_it(out, stamp)
    return {"builder_s": time.perf_counter() - t0, "peak_rss_bytes": peak}


def checkpoint_values(ckpt: Path) -> int | None:
    """The number of weight values in a checkpoint folder's safetensors files, from their headers (None where one cannot
    be read)."""
    from edgelin.errors import CheckpointError
    from edgelin.streaming import value_counts

    try:
        return sum(count for _, _, count in value_counts(sorted(ckpt.glob("*.safetensors"))))
    except CheckpointError:
        return None


def edgelin_export(ckpt: Path, out: Path, precision: str, ops: str, say: Progress, trace_cache: Path | None = None) -> dict[str, Any]:
    """``edgelin export`` of ``ckpt`` at ``precision`` (a name of EXPORT_OPTIONS) with ``--ops ops``, checked against PyTorch
    (where the check fails: exported unchecked, the failure recorded), in a process of its own (its peak resident memory
    and the export's own peak, anonymous memory, recorded); reused while its stamp matches (with the figures of the run
    that made it). ``trace_cache``: a folder its traced graphs are kept in for the next
    precision's export."""
    options = {**EXPORT_OPTIONS[precision], "ops": ops}
    stamp = {"checkpoint": str(ckpt), "checkpoint_fingerprint": folder_fingerprint(ckpt), "options": options, "code": code_fingerprint()}
    if stamped_export(out, stamp):
        return {**json.loads((out / STAMP).read_text()), "reused": True}
    say(f"genai: edgelin export {precision} --ops {ops} -> {out} ...")
    t0 = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    spec = {"checkpoint": str(ckpt), "out": str(out), "options": options, "trace_cache": None if trace_cache is None else str(trace_cache)}
    code, stdout, stderr, peak = run_peak([sys.executable, "-m", "edgelin.bench", "--export-checked", json.dumps(spec)])
    lines = [x for x in stdout.splitlines() if x.strip()]
    if code != 0 or not lines:
        errs = [x.strip() for x in stderr.splitlines() if x.strip()]
        why = f"ran past {TIMEOUT:.0f} s" if code is None else f"killed by signal {-code}" if code < 0 else (errs or [f"exit status {code}"])[-1][:300]
        raise BenchError(f"edgelin export {precision} --ops {ops} of {ckpt} failed: {why}")
    got = json.loads(lines[-1])
    made = {**stamp, "check": got["check"], "export_s": time.perf_counter() - t0, "peak_rss_bytes": peak, "peak_own_bytes": got.get("peak_own_bytes")}
    stamp_it(out, made)
    return made


def stamped_export(out: Path, stamp: dict[str, Any]) -> bool:
    """Whether ``out`` holds an export made as ``stamp`` says (its stamp adds the check and the time taken)."""
    try:
        got = json.loads((out / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return all(got.get(k) == v for k, v in stamp.items())


def weight_files(folder: Path) -> dict[str, int]:
    """The bytes of an export's graph and weight files (.onnx, .data, .onnx.data), by name."""
    return {f.name: f.stat().st_size for f in sorted(folder.iterdir()) if f.suffix in (".onnx", ".data")}


# ---- llama.cpp beside them --------------------------------------------------------------------------
def llama_no_repack(help_text: str) -> list[str] | None:
    """llama-bench's flag turning repacking off, read from its --help (``--repack 0`` or ``-nr 1``), or None."""
    if "--repack" in help_text.replace("--no-repack", ""):
        return ["--repack", "0"]
    if "--no-repack" in help_text:
        return ["-nr", "1"]
    return None


def llama_round(bench_bin: Path, gguf: Path, threads: int, prompt: int, decode: int, no_repack: list[str] | None,
                path: dict[str, str]) -> dict[str, Any]:
    """One llama-bench run (``-p PROMPT -n DECODE -r 1``) as figures; ``path`` holds which path ran for this GGUF: its
    default (repacked weights) or, where that crashed (a signal), repacking off, said in ``path["why"]``."""
    from .llamacpp import parse_llama_bench

    base = [str(bench_bin), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(decode), "-r", "1", "-o", "json"]
    extra = no_repack if path.get("ran") == "repacking off" else []
    code, stdout, stderr, peak = run_peak(base + (extra or []))
    if code is not None and code < 0 and not extra and no_repack:
        path.update(ran="repacking off", why=f"the default (repacked) path was killed by signal {-code}; ran with {' '.join(no_repack)}")
        code, stdout, stderr, peak = run_peak(base + no_repack)
    path.setdefault("ran", "default (repacked)")
    if code != 0 or not stdout.strip():
        why = f"did not finish within {TIMEOUT:.0f} s" if code is None else f"killed by signal {-code}" if code < 0 else \
            ([x for x in stderr.splitlines() if x.strip()] or [f"exit status {code}, no output"])[-1][:300]
        return {"status": "failed", "reason": f"llama-bench: {why}"}
    got = parse_llama_bench(stdout)
    return {"prefill_tokens_per_s": got[f"pp{prompt}"], "decode_tokens_per_s": got[f"tg{decode}"], "decode_ms": 1e3 / got[f"tg{decode}"],
            "peak_rss_bytes": peak}


def layers_of(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int((cfg.get("text_config") or cfg)["num_hidden_layers"])


def vocab_of(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    return int((cfg.get("text_config") or cfg)["vocab_size"])


# ---- the plan ------------------------------------------------------------------------------------------------
def contenders(precision: str, ops: Sequence[str], llama: bool) -> list[str]:
    """The contenders of one precision, in round order: edgelin per lowering, genai, llama.cpp where it runs that type."""
    out = [f"edgelin {o}" for o in ops] + ["genai"]
    return out + ([f"llama.cpp {GGUF[precision]}"] if llama and precision in GGUF else [])


def profiled(precision: str, ops: Sequence[str]) -> list[str]:
    """The contenders whose decode steps ONNX Runtime profiles (llama.cpp runs no ONNX Runtime)."""
    return contenders(precision, ops, False)


def plan_of(plan: Plan, models: Sequence[str], precisions: Sequence[str], threads: Sequence[int], ops: Sequence[str],
            llama: bool, profile: bool = True) -> list[dict[str, Any]]:
    """What the section runs, in order: per model, the builds and exports, then per precision and thread count the rounds
    (each a list of contenders in the order they run: reversed every other round), and with ``profile`` after the rounds at
    the most threads one profiled run of each contender that runs on ONNX Runtime."""
    steps: list[dict[str, Any]] = []
    for m in models:
        steps.append({"model": m, "step": "checkpoint"})
        for p in dict.fromkeys(GENAI_PRECISION[p] for p in precisions):
            steps.append({"model": m, "step": "genai build", "precision": p})
        for p in precisions:
            for o in ops:
                steps.append({"model": m, "step": "edgelin export", "precision": p, "ops": o})
        if llama:
            steps.append({"model": m, "step": "gguf", "types": list(dict.fromkeys(GGUF[p] for p in precisions if p in GGUF))})
        for p in precisions:
            for t in threads:
                names = contenders(p, ops, llama)
                steps.append({"model": m, "step": "rounds", "precision": p, "threads": t,
                              "rounds": [round_order(names, r) for r in range(plan.genai_rounds)]})
                if profile and t == max(threads):
                    steps.append({"model": m, "step": "profile", "precision": p, "threads": t, "contenders": profiled(p, ops)})
    return steps


def describe_plan(steps: list[dict[str, Any]], plan: Plan) -> list[str]:
    """The plan as lines for the progress output (what will run and what it measures)."""
    lines = [f"genai: plan: prefill = one {plan.genai_prompt}-token call; decode = median step of {plan.genai_decode} greedy steps "
             f"after it; {plan.genai_rounds} round(s), each contender in its own process, the order reversed every other round"]
    for s in steps:
        if s["step"] == "rounds":
            lines.append(f"  {s['model']} {s['precision']} at {s['threads']} thread(s): " + " | ".join(", ".join(r) for r in s["rounds"]))
        elif s["step"] == "profile":
            lines.append(f"  {s['model']} {s['precision']} at {s['threads']} thread(s): then one run each with ONNX Runtime's profiler "
                         f"(not timed): {', '.join(s['contenders'])}")
    return lines


# ---- the section -------------------------------------------------------------------------------------------------
def genai_section(plan: Plan, threads: int, say: Progress, *, checkpoint: str | os.PathLike | None = None,
                  models: Sequence[str] | None = None, precisions: Sequence[str] | None = None,
                  thread_counts: Sequence[int] | None = None, rounds: int | None = None, ops: Sequence[str] = OPS,
                  venv: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                  record_dir: str | os.PathLike | None = None, on_model: Callable[[str, dict[str, Any]], None] | None = None,
                  build: Callable[..., Path] = build_checkpoint, profile: bool = True) -> dict[str, Any]:
    """The section: every model of ``models`` (default the plan's ``genai_models``; or the one ``checkpoint`` folder) at every
    precision of ``precisions`` (default the plan's; names of EXPORT_OPTIONS) at ``thread_counts`` (default the plan's and
    ``threads``), edgelin's lowerings ``ops``; ``on_model(name, part)`` is called with each model's part as it completes
    (the CLI writes its record then). ``profile``: after each precision's rounds at the most threads, one more run of each
    contender on ONNX Runtime with its profiler on, recorded as kernel time by operator type in the median decode step
    (``edgelin.bench.ortprofile``)."""
    import dataclasses

    if rounds is not None:
        plan = dataclasses.replace(plan, genai_rounds=int(rounds))
    precisions = tuple(precisions or plan.genai_precisions)
    unknown = [p for p in precisions if p not in EXPORT_OPTIONS]
    if unknown:
        raise BenchError(f"genai precisions: unknown {', '.join(unknown)}; choose from {', '.join(EXPORT_OPTIONS)}")
    bad_ops = [o for o in ops if o not in OPS]
    if bad_ops or not ops:
        raise BenchError(f"genai ops: {', '.join(bad_ops) or 'none given'}; choose from {', '.join(OPS)}")
    if checkpoint is not None:
        ckpt_given = Path(checkpoint)
        if not (ckpt_given / "config.json").is_file():
            raise BenchError(f"--checkpoint {ckpt_given}: no config.json there; pass a transformers checkpoint folder (config.json + "
                             "*.safetensors) that both tools read, e.g. an LFM2 or Qwen3.5 one")
        names = [ckpt_given.resolve().name]
    else:
        names = list(models or plan.genai_models)
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            raise BenchError(f"genai models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)} or pass --checkpoint DIR")
    thread_counts = sorted(set(thread_counts or (*plan.genai_threads, threads)))
    cache = Path(cache_dir) if cache_dir is not None else default_dir()
    from .llamacpp import binaries, find_llama_cpp, to_gguf

    src, llama_why = find_llama_cpp()
    steps = plan_of(plan, names, precisions, thread_counts, ops, src is not None, profile)
    for line in describe_plan(steps, plan):
        say(line)
    py, versions = ensure_venv(Path(venv) if venv is not None else None, cache, say)
    say(f"genai: onnxruntime-genai {versions['onnxruntime_genai']} (onnxruntime {versions['onnxruntime']}) from {py}")
    llama_help, no_repack = "", None
    if src is not None:
        llama_help = subprocess.run([str(binaries(src)["llama-bench"]), "--help"], capture_output=True, text=True).stdout
        no_repack = llama_no_repack(llama_help)
    rng = np.random.default_rng(DATA_SEED)
    out_models: dict[str, Any] = {}
    load = {"start": load_average()}
    for name in names:
        ckpt = ckpt_given if checkpoint is not None else checkpoint_for(name, cache, say, build)
        work = cache / name
        work.mkdir(parents=True, exist_ok=True)
        n_layers, vocab = layers_of(ckpt), vocab_of(ckpt)
        prompt = rng.integers(0, vocab, plan.genai_prompt).tolist()
        entry: dict[str, Any] = {"checkpoint": str(ckpt), "built_here": checkpoint is None, "layers": n_layers, "vocab_size": vocab,
                                 "config": MODELS[name][1] if checkpoint is None else json.loads((ckpt / "config.json").read_text()),
                                 "exports": {}, "rows": [], "greedy": {}, "failed": [], "profiles": {}}
        folders: dict[tuple[str, str], Path] = {}
        no_genai: set[str] = set()  # genai precisions its builder could not make: the other contenders go on without it
        for gp in dict.fromkeys(GENAI_PRECISION[p] for p in precisions):
            out = work / f"genai-{gp}"
            try:
                built = genai_build(py, versions, ckpt, out, gp, say) or {}
            except BenchError as exc:
                say(f"    {exc}; the other contenders go on without it")
                entry["failed"].append({"precision": gp, "contender": "genai", "round": "build", "status": "failed", "reason": str(exc)})
                no_genai.add(gp)
                for left in (out, work / f"{out.name}-cache"):  # the failed build's folders
                    shutil.rmtree(left, ignore_errors=True)
                continue
            entry["exports"][f"genai {gp}"] = {"folder": str(out), "files": weight_files(out), "builder_s": built.get("builder_s"),
                                               "peak_rss_bytes": built.get("peak_rss_bytes"),
                                               "command": " ".join(builder_command(py, ckpt, out, gp, out.parent / f"{out.name}-cache"))}
        # a trace cache holds a traced graph's weights in float32: kept for a second precision where the disk has room for it
        values = checkpoint_values(ckpt)
        keep_traces = len(precisions) > 1 and values is not None and 8 * values < shutil.disk_usage(work).free
        for p in precisions:
            for o in ops:
                out = work / f"edgelin-{p}-{o}"
                made = edgelin_export(ckpt, out, p, o, say, work / f"traces-{o}" if keep_traces else None)
                folders[p, o] = out
                entry["exports"][f"edgelin {p} {o}"] = {"folder": str(out), "files": weight_files(out), "check": made.get("check"),
                                                         "export_s": made.get("export_s"), "reused": bool(made.get("reused")),
                                                         "peak_rss_bytes": made.get("peak_rss_bytes"), "peak_own_bytes": made.get("peak_own_bytes"),
                                                         "options": made.get("options")}
        for o in ops:  # the traces served this run's precisions; the next run's code may differ: gigabytes not kept
            shutil.rmtree(work / f"traces-{o}", ignore_errors=True)
        ggufs: dict[str, Path] = {}
        if src is not None:
            kinds = tuple(dict.fromkeys(GGUF[p] for p in precisions if p in GGUF))
            say(f"genai: {name}: GGUF {'/'.join(kinds)} with llama.cpp's converter ...")
            try:
                ggufs = to_gguf(src, ckpt, fresh(work / "gguf"), kinds)
            except BenchError as exc:  # the other contenders go on without llama.cpp's rows
                entry["llama_cpp_failed"] = str(exc)
                say(f"    llama.cpp: {exc}")
            entry["exports"].update({f"llama.cpp {k}": {"folder": str(g.parent), "files": {g.name: g.stat().st_size}} for k, g in ggufs.items()})
        say(f"genai: {name}: decode nodes per layer as run ...")
        nodes = {}
        for gp in dict.fromkeys(GENAI_PRECISION[p] for p in precisions if GENAI_PRECISION[p] not in no_genai):
            nodes[f"genai {gp}"] = count_nodes(py, work / f"genai-{gp}" / "model.onnx")
        for (p, o), out in folders.items():
            nodes[f"edgelin {p} {o}"] = count_nodes(sys.executable, out / "decode.onnx")
        for n in nodes.values():
            if "as_run" in n:
                n["as_run_per_layer"] = n["as_run"] / n_layers
        entry["decode_nodes"] = nodes
        llama_paths: dict[str, dict[str, str]] = {}
        for p in precisions:
            for T in thread_counts:
                names_now = [c for c in contenders(p, ops, bool(ggufs)) if c != "genai" or GENAI_PRECISION[p] not in no_genai]
                say(f"genai: {name} {p}, {T} thread(s): {plan.genai_rounds} round(s) of {', '.join(names_now)}, each in its own process ...")
                got: dict[str, list[dict[str, Any]]] = {c: [] for c in names_now}
                for r in range(plan.genai_rounds):
                    for c in round_order(names_now, r):
                        spec = {"prompt": prompt, "threads": T, "decode": plan.genai_decode, "warmup": WARMUP_STEPS}
                        if c == "genai":
                            spec["folder"] = str(work / f"genai-{GENAI_PRECISION[p]}")
                            res = figures(measure_process([str(py), "-c", GENAI_ROUND, json.dumps(spec)], "genai's round"), plan.genai_prompt)
                        elif c.startswith("edgelin"):
                            spec["folder"] = str(folders[p, c.split()[1]])
                            res = figures(measure_process([sys.executable, "-m", "edgelin.bench", "--genai-round", json.dumps(spec)],
                                                          "edgelin's round"), plan.genai_prompt)
                        else:
                            kind = c.split()[1]
                            path = llama_paths.setdefault(kind, {})
                            res = llama_round(binaries(src)["llama-bench"], ggufs[kind], T, plan.genai_prompt, plan.genai_decode, no_repack, path)
                        if "status" in res:
                            say(f"    {c}: {res['status']}: {res['reason']}")
                            entry["failed"].append({"precision": p, "threads": T, "contender": c, "round": r, **res})
                        else:
                            got[c].append(res)
                rows = summarise(name, p, T, got, entry, nodes, llama_paths)
                entry["rows"] += rows
                if profile and T == max(thread_counts):
                    entry["profiles"][p] = profile_decode([c for c in profiled(p, ops) if c in names_now], p, T, prompt, plan, work, py, folders,
                                                          entry, say)
                for row in rows:
                    say(f"    {row['contender']:28s} decode {row['decode_tokens_per_s']:8.2f} tok/s, prefill {row['prefill_tokens_per_s']:8.1f} tok/s"
                        + (f"  (edgelin / genai: decode {row['decode_over_genai']:.2f}x, prefill {row['prefill_over_genai']:.2f}x; "
                           f"decode {said_rounds(row['decode_over_genai_rounds'])})" if "decode_over_genai" in row else ""))
        entry["llama_cpp_paths"] = llama_paths
        entry["load_average_end"] = load_average()
        out_models[name] = entry
        part = section_part({name: entry}, plan, precisions, thread_counts, ops, versions, src, llama_why, load)
        if record_dir is not None:
            say(f"genai: wrote {write_model_record(Path(record_dir), name, part, max(thread_counts))}")
        if on_model is not None:
            on_model(name, part)
    return section_part(out_models, plan, precisions, thread_counts, ops, versions, src, llama_why, load)


def profile_decode(names: Sequence[str], precision: str, threads: int, prompt: list[int], plan: Plan, work: Path, py: Path,
                   folders: dict[tuple[str, str], Path], entry: dict[str, Any], say: Progress) -> dict[str, Any]:
    """One run of each contender of ``names`` with ONNX Runtime's profiler on (its own process, as a round, not timed): kernel
    microseconds by operator type in the median of its ``genai_decode`` greedy steps (``decode_profile``), said side by side. A contender whose
    profile cannot be had is left out of the comparison and its reason recorded in ``entry["failed"]``."""
    from .ortprofile import compare_lines, decode_profile

    say(f"genai: {precision}, {threads} thread(s): one profiled run each of {', '.join(names)} ...")
    out: dict[str, Any] = {}
    folder = fresh(work / "profiles")
    try:
        for c in names:
            spec = {"prompt": prompt, "threads": threads, "decode": plan.genai_decode, "warmup": WARMUP_STEPS,
                    "profile": str(folder / c.replace(" ", "-"))}
            Path(spec["profile"]).mkdir()
            if c == "genai":
                spec["folder"] = str(work / f"genai-{GENAI_PRECISION[precision]}")
                raw = measure_process([str(py), "-c", GENAI_ROUND, json.dumps(spec)], "genai's profiled run")
            else:
                spec["folder"] = str(folders[precision, c.split()[1]])
                raw = measure_process([sys.executable, "-m", "edgelin.bench", "--genai-round", json.dumps(spec)], "edgelin's profiled run")
            try:
                if "status" in raw:
                    raise BenchError(raw["reason"])
                if not raw.get("profile"):
                    raise BenchError(f"{c}: no profile was written")
                # genai's first generate_next_token after the prompt picks from the prompt's logits: its N steps run the
                # graph N - 1 times (the run before them is the prompt's); edgelin's N steps run the decode graph N times
                out[c] = decode_profile(raw["profile"], plan.genai_decode - (c == "genai"))
            except BenchError as exc:
                say(f"    {c}: profile failed: {exc}")
                entry["failed"].append({"precision": precision, "threads": threads, "contender": c, "round": "profile",
                                        "status": "failed", "reason": str(exc)})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if out:
        for line in compare_lines(out):
            say("    " + line)
    return {"threads": threads, "contenders": out}


def summarise(model: str, precision: str, threads: int, got: dict[str, list[dict[str, Any]]], entry: dict[str, Any],
              nodes: dict[str, Any], llama_paths: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """The rows of one precision and thread count: per contender the medians over its rounds, its weight bytes and decode nodes
    per layer, and edgelin / genai; the greedy ids of each export against genai's (recorded once per precision)."""
    rows = []
    gp = GENAI_PRECISION[precision]
    base = got.get("genai") or []
    for c, rounds in got.items():
        if not rounds:
            continue
        key = f"genai {gp}" if c == "genai" else f"edgelin {precision} {c.split()[1]}" if c.startswith("edgelin") else f"llama.cpp {c.split()[1]}"
        row: dict[str, Any] = {"model": model, "precision": precision, "threads": threads, "contender": c, "rounds": len(rounds),
                               "decode_tokens_per_s": float(np.median([r["decode_tokens_per_s"] for r in rounds])),
                               "decode_ms": float(np.median([r["decode_ms"] for r in rounds])),
                               "prefill_tokens_per_s": float(np.median([r["prefill_tokens_per_s"] for r in rounds])),
                               "decode_rounds": [r["decode_tokens_per_s"] for r in rounds],
                               "prefill_rounds": [r["prefill_tokens_per_s"] for r in rounds],
                               "decode_spread": spread([r["decode_tokens_per_s"] for r in rounds]),
                               "peak_rss_bytes": _median_of(rounds, "peak_rss_bytes"),
                               "weight_bytes": sum(entry["exports"].get(key, {}).get("files", {}).values()) or None,
                               "decode_nodes_per_layer": (nodes.get(key) or {}).get("as_run_per_layer"),
                               "load_average": load_average()}
        if c.startswith("llama.cpp"):
            row["llama_cpp_path"] = dict(llama_paths.get(c.split()[1], {}))
        if base and c != "genai":
            g = {k: float(np.median([r[k] for r in base])) for k in ("decode_tokens_per_s", "prefill_tokens_per_s")}
            row["decode_over_genai"] = row["decode_tokens_per_s"] / g["decode_tokens_per_s"]
            row["prefill_over_genai"] = row["prefill_tokens_per_s"] / g["prefill_tokens_per_s"]
            for k in ("decode", "prefill"):  # how far the rounds resolve each ratio (the machine's speed moves between processes)
                row[f"{k}_over_genai_rounds"] = ratio_rounds(row[f"{k}_rounds"], [r[f"{k}_tokens_per_s"] for r in base])
        if "ids" in rounds[0] and precision not in entry["greedy"].get(c, {}):
            ids = rounds[0]["ids"]
            entry["greedy"].setdefault(c, {})[precision] = {"ids": ids}
            if base and c != "genai":
                theirs = base[0]["ids"]
                first = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
                entry["greedy"][c][precision].update(same_as_genai_before=first, agreement=first / max(len(theirs), 1))
        rows.append(row)
    return rows


def _median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    got = [r[key] for r in rounds if r.get(key) is not None]
    return float(np.median(got)) if got else None


def section_part(models: dict[str, Any], plan: Plan, precisions: Sequence[str], thread_counts: Sequence[int], ops: Sequence[str],
                 versions: dict[str, str], src: Path | None, llama_why: str, load: dict[str, Any]) -> dict[str, Any]:
    from .llamacpp import versions as llama_versions

    return {
        "status": "ok",
        "what": f"edgelin vs onnxruntime-genai on the same transformers checkpoint: prefill tokens/s of one {plan.genai_prompt}-token "
                f"call, decode = the median step of {plan.genai_decode} greedy steps after it (genai: generate_next_token; edgelin: "
                "argmax + Session.decode), batch 1; each contender in its own process per round (load, warm-up, then timed), "
                f"{plan.genai_rounds} round(s) in alternating order; medians over rounds; ratio edgelin / genai (above 1: edgelin faster); "
                "beside each ratio its rounds: the best rounds' ratio, the back-to-back pairs' ratios, any round over any round "
                "(span) and the verdict (faster / slower where every pairing agrees, else not resolved)",
        "prompt_tokens": plan.genai_prompt, "decode_steps": plan.genai_decode, "rounds": plan.genai_rounds,
        "precisions": list(precisions), "precision_names": {p: DESCRIBE.get(p, p) for p in precisions},
        "threads": list(thread_counts), "ops": list(ops), "models": models,
        "versions": {**versions, "edgelin_onnxruntime": _ort_version()},
        "llama_cpp": {"status": "ok", **llama_versions(src)} if src is not None else {"status": "skipped", "reason": llama_why},
        "load_average": {**load, "end": load_average()},
    }


def write_model_record(folder: Path, name: str, part: dict[str, Any], threads: int) -> Path:
    """``folder/genai-NAME.json``: a bench record (``report.record``) holding this section's part for one model, written
    atomically as soon as the model is done (an earlier record of this bench there is replaced)."""
    from edgelin.runtime.files import write_json

    from .harness import machine_facts
    from .report import BENCH_JSON, record

    machine = machine_facts()
    machine["load_average_start"] = part["load_average"]["start"]
    settings = {"threads": threads, "provider_requested": "cpu", "provider_active": "CPUExecutionProvider", "sections": ["genai"]}
    data = record({"genai": part}, machine=machine, settings=settings, quick=False, model=None, started=time.perf_counter())
    data.pop("seconds", None)
    folder.mkdir(parents=True, exist_ok=True)
    return write_json(folder / f"genai-{name}.json", data, ours=BENCH_JSON, what="bench report")


def _ort_version() -> str | None:
    from .harness import dist_version

    return dist_version("onnxruntime-gpu", "onnxruntime")


__all__ = ["ENV_DIR", "EXPORT_OPTIONS", "GENAI_PRECISION", "MODELS", "OPS", "VENV_PACKAGES", "contenders", "default_dir", "ensure_venv",
           "genai_build", "genai_section", "llama_no_repack", "llama_round", "plan_of", "summarise", "venv_python"]
