"""The ``llamacpp`` section: edgelin against llama.cpp, the CPU competitor, on the same transformers checkpoints.

Opt-in twice over: named with ``--section llamacpp``, and found through ``EDGELIN_LLAMA_CPP`` = a llama.cpp source
folder built by ``scripts/llamacpp_build.sh DIR`` (``DIR/llama.cpp``: the source vendored in PyPI's llama-cpp-python
sdist, its ``build/bin/llama-bench`` and ``llama-quantize``, its ``convert_hf_to_gguf.py``); without it the section is
skipped, with the reason. The build takes minutes: never part of ``make test``.

For each model of ``MODELS`` (an LFM2 hybrid and a Mamba2, both of the bundled model's weight size: hidden 256,
4 layers; random weights, perturbed so the logits spread, with a byte-level BPE tokenizer of 512 tokens, built and saved by
transformers' own classes in a subprocess) and each precision of ``PRECISIONS`` (``scripts/llamacpp_bench.py --model``
passes instead one published configuration at real size, a tokenizer of its vocabulary, and fewer precisions):

    llama.cpp  the checkpoint converted by llama.cpp's own converter to GGUF F32 and F16 (a locally made tokenizer's
               pre-tokenizer hash is unknown to it: declared "gpt-2", which changes nothing for speed), Q8_0 and Q4_0
               quantised from F32 by llama-quantize (its default tensor mix for the type; ``to_gguf``)
    edgelin    the checkpoint exported (``edgelin.exporters.export``) at fp32 / fp16 / int8 / int4, with the exporter's
               check against PyTorch (where it fails: exported unchecked, and the failure recorded)

then, per thread count (1 and 2, and --threads), in ``plan.llama_rounds`` rounds that alternate the order:
llama-bench once (``-p L1,L2 -n N -r 1``: prefill tokens/s ``ppL`` and decode tokens/s ``tgN``, each after its own
warm-up run) and edgelin once in each of its runtimes (``RUNTIMES``; N decode calls from an empty state: tokens/s = N
/ their total time; one prefill of L tokens per length through the runtime's prefill with its defaults -- pieces of
the manifest's prefill_piece, 1,024, the state carried, as a user's prompt goes, as llama.cpp cuts a prompt into
micro-batches of 512: L / its time) -- the Python runtime's Session (IO
binding where the state does not grow), and runtime/web/edgelin.mjs in node on onnxruntime-node and on
onnxruntime-web's WASM backend (``scripts/llamacpp_round.mjs``, a node process per round that loads and warms up
first). Reported: medians over the rounds and edgelin / llama.cpp per runtime (tokens/s ratio: above 1, edgelin is
faster).

Greedy agreement: ``GREEDY`` greedy ids after the same ``PROMPT`` prompt ids, from transformers (``edgelin.upstream``:
its own model, fp32, cached decode), from each edgelin export (Session prefill + decode, argmax), and from each GGUF
(the sdist's own ctypes bindings ``llama_cpp.llama_cpp`` on the build's ``libllama``: ``llama_decode`` of the prompt
ids in one batch, then the argmax of ``llama_get_logits_ith(ctx, -1)`` fed back one token at a time); each compared
with transformers' ids (``upstream.greedy_agreement``: the fraction before the first difference); and, with transformers'
ids fed instead of each engine's own, the fraction of steps whose argmax is transformers' id ("forced_top1").
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime

from edgelin.runtime.session import Session

from . import checkpoints
from .checkpoints import FAMILIES, VOCAB, build_checkpoint
from .harness import JS_PACKAGES, ROOT, load_average, median_of, node_json, round_order, run_command
from .plan import DATA_SEED, BenchError, Plan, Progress

ENV = "EDGELIN_LLAMA_CPP"
BUILD = "bash scripts/llamacpp_build.sh DIR (minutes), then EDGELIN_LLAMA_CPP=DIR/llama.cpp"
PRECISIONS = {"fp32": "F32", "fp16": "F16", "int8": "Q8_0", "int4": "Q4_0"}  # edgelin precision -> GGUF type
# other edgelin exports a run may ask for by name (scripts/llamacpp_bench.py --precisions): name -> (export options, GGUF type)
VARIANTS = {"int8-block": ({"precision": "int8", "int8_scheme": "block"}, "Q8_0"),
            # per-channel int8 and an fp32 table: no MatMulNBits node, which onnxruntime-web's WASM backend decodes several
            # times slower than fp32 (edgelin.web.WASM_NOTE)
            "int8-channel-fp32-table": ({"precision": "int8", "int8_scheme": "channel", "embedding": "fp32"}, "Q8_0")}
CONVERTED = {"F32": "f32", "F16": "f16"}  # written by the converter; the others quantised by llama-quantize (to_gguf)
MODELS = {name: FAMILIES[name] for name in ("lfm2", "mamba2")}  # an LFM2 hybrid and a Mamba2 (checkpoints.FAMILIES)
RUNTIMES = ("python", "node", "wasm")  # edgelin's runtimes timed against llama.cpp: the Python Session, runtime/web/edgelin.mjs
# in node on onnxruntime-node (native CPU) and on onnxruntime-web's WASM backend (the kernels a browser's wasm provider runs)
JS_ROUND = ROOT / "scripts" / "llamacpp_round.mjs"  # a source checkout's; node_modules beside it
PROMPT, GREEDY = 32, 16
TIMEOUT = 1800.0  # seconds for one conversion, quantisation or llama-bench run


def binaries(src: Path) -> dict[str, Path]:
    return {"llama-bench": src / "build" / "bin" / "llama-bench", "llama-quantize": src / "build" / "bin" / "llama-quantize",
            "converter": src / "convert_hf_to_gguf.py"}


def find_llama_cpp(environ=os.environ) -> tuple[Path | None, str]:
    """(the llama.cpp source folder, "") or (None, why it cannot be used: one line naming the build step)."""
    value = environ.get(ENV, "").strip()
    if not value:
        return None, f"{ENV} is not set; to compare with llama.cpp: {BUILD}"
    src = Path(value).expanduser()
    missing = [str(path.relative_to(src)) for path in binaries(src).values() if not path.is_file()]
    if missing:
        return None, f"{ENV}={value} lacks {', '.join(missing)}; build it: {BUILD}"
    return src, ""


def parse_llama_bench(text: str) -> dict[str, float]:
    """llama-bench's ``-o json`` output -> {"pp512": tokens/s, "tg128": tokens/s, ...} (its avg_ts per test)."""
    rows = json.loads(text)
    out = {}
    for r in rows:
        name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}" if r["n_prompt"] == 0 else f"pp{r['n_prompt']}+tg{r['n_gen']}"
        out[name] = float(r["avg_ts"])
    return out


def _run(cmd: list, what: str, **kw) -> str:
    return run_command(cmd, what, BenchError, TIMEOUT, **kw)


def versions(src: Path) -> dict[str, Any]:
    """llama.cpp as built (llama-bench's own build fields are read from its JSON) and the sdist it came from."""
    info = next(src.parent.glob("llama_cpp_python-*/PKG-INFO"), None)
    lines = info.read_text(encoding="utf-8").splitlines() if info else []
    sdist = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Version:")), None)
    return {"llama_cpp_python_sdist": sdist, "source": str(src)}


# ---- llama.cpp: conversion, greedy ids --------------------------------------------------------------
CONVERT = """
import sys
sys.path[:0] = ["gguf-py", "."]
sys.modules["triton"] = None; sys.modules["fla"] = None
import convert_hf_to_gguf as c, conversion.base as cb
known = cb.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try: return known(self, tokenizer)
    except NotImplementedError: return "gpt-2"   # a locally made tokenizer: its pre-tokenizer hash is unknown
cb.TextModel.get_vocab_base_pre = pre
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
c.main()
"""


def to_gguf(src: Path, ckpt: Path, out: Path, kinds: tuple[str, ...] = tuple(PRECISIONS.values())) -> dict[str, Path]:
    """GGUF files of ``ckpt`` per GGUF type of ``kinds``, in ``out``: F32 / F16 written by the converter, the quantised
    types by llama-quantize from F32 where F32 is asked for, else from F16 (half the disk: a real-size model's F32 file
    may not fit beside the rest), which is then removed unless asked for."""
    files = {}
    source = "F32" if "F32" in kinds else "F16"
    wanted = {k for k in kinds if k in CONVERTED} | ({source} if set(kinds) - set(CONVERTED) else set())
    for kind, outtype in CONVERTED.items():
        if kind not in wanted:
            continue
        files[kind] = out / f"{kind}.gguf"
        _run([sys.executable, "-c", CONVERT, ckpt.resolve(), "--outfile", files[kind].resolve(), "--outtype", outtype],
             f"llama.cpp's converter ({outtype})", cwd=src)
    for kind in kinds:
        if kind not in files:
            files[kind] = out / f"{kind}.gguf"
            _run([binaries(src)["llama-quantize"], files[source], files[kind], kind, "1"], f"llama-quantize {kind}")
    if source not in kinds and source in files:
        files.pop(source).unlink()
    return files


def llama_greedy_main(spec: dict[str, Any]) -> None:
    """In ``python -m edgelin.bench --llama-greedy SPEC``: the greedy ids of a GGUF through the llama-cpp-python sdist's
    ctypes bindings (its package ``__init__`` needs more than ctypes: only the bindings module is loaded), printed as JSON."""
    import types

    package = types.ModuleType("llama_cpp")
    package.__path__ = [spec["bindings"]]
    sys.modules["llama_cpp"] = package
    os.environ["LLAMA_CPP_LIB_PATH"] = spec["lib"]
    import llama_cpp.llama_cpp as ll  # noqa: E402 -- after the package stub

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(spec["gguf"].encode(), ll.llama_model_default_params())
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))

    def argmaxes(forced: list[int] | None) -> list[int]:
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 512, 512, 1, 1
        ctx = ll.llama_init_from_model(model, params)
        ids, out = list(spec["prompt"]), []
        for t in range(spec["greedy"]):
            tokens = (ll.llama_token * len(ids))(*ids)
            if ll.llama_decode(ctx, ll.llama_batch_get_one(tokens, len(ids))) != 0:
                raise RuntimeError("llama_decode failed")
            out.append(int(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).argmax()))
            ids = [out[-1] if forced is None else forced[t]]
        ll.llama_free(ctx)
        return out

    print(json.dumps({"ids": argmaxes(None), "forced_argmax": argmaxes(spec["forced"])}))
    ll.llama_model_free(model)


def llama_greedy(src: Path, gguf: Path, prompt: np.ndarray, forced: list[int]) -> dict[str, Any]:
    bindings = next(src.parent.glob("llama_cpp_python-*/llama_cpp"), None)
    lib = next((p.parent for p in (src / "build").glob("bin/libllama.*")), None)
    if bindings is None or lib is None:
        return {"status": "unavailable", "reason": f"needs the llama-cpp-python sdist's llama_cpp/ beside {src} and {src}/build/bin/libllama "
                                                   "(scripts/llamacpp_build.sh leaves both)"}
    spec = {"bindings": str(bindings), "lib": str(lib), "gguf": str(gguf), "prompt": prompt.tolist(), "greedy": GREEDY, "forced": forced}
    try:
        out = json.loads(_run([sys.executable, "-m", "edgelin.bench", "--llama-greedy", json.dumps(spec)], "llama.cpp's greedy ids").splitlines()[-1])
    except (BenchError, ValueError, IndexError) as exc:
        return {"status": "failed", "reason": str(exc)}
    return {"status": "ok", **out}


# ---- edgelin -----------------------------------------------------------------------------------------
def edgelin_greedy(sess: Session, prompt: np.ndarray, forced: list[int]) -> dict[str, Any]:
    """Like ``llama_greedy``: {"ids": greedy ids, "forced_argmax": the argmax at each step when ``forced`` is fed instead}."""

    def argmaxes(forced: list[int] | None) -> list[int]:
        state = sess.new_state(1)
        logits, out = sess.prefill(prompt[None], state, last_only=True), []
        for t in range(GREEDY):
            out.append(int(logits[0].argmax()))
            logits = sess.decode(np.asarray([[out[-1] if forced is None else forced[t]]]), state)[:, -1]
        return out

    return {"status": "ok", "ids": argmaxes(None), "forced_argmax": argmaxes(forced)}


def edgelin_round(sess: Session, n_decode: int, lengths: tuple[int, ...], rng: np.random.Generator) -> dict[str, float]:
    """One edgelin measurement: {"tgN": decode tokens/s over N calls from an empty state, "ppL": prefill tokens/s}
    (random ids below VOCAB: every model here has at least that many)."""
    clock = time.perf_counter
    state, ids = sess.new_state(1), rng.integers(0, VOCAB, (1, n_decode), dtype=np.int64)
    total = 0.0
    for t in range(n_decode):
        t0 = clock()
        sess.decode(ids[:, t : t + 1], state)
        total += clock() - t0
    out = {f"tg{n_decode}": n_decode / total}
    for L in lengths:
        ids, state = rng.integers(0, VOCAB, (1, L), dtype=np.int64), sess.new_state(1)
        t0 = clock()
        sess.prefill(ids, state, last_only=True)  # the runtime's default pieces (the earlier records: one call of L tokens)
        out[f"pp{L}"] = L / (clock() - t0)
    return out


def js_round(runtime: str, folder: Path, threads: int, n_decode: int, lengths: tuple[int, ...]) -> dict[str, Any]:
    """One measurement like ``edgelin_round`` in a JavaScript runtime (scripts/llamacpp_round.mjs: a node process that
    loads the export, warms up and times N decode calls from an empty state and one prefill per length in the
    runtime's default pieces; "failed": {key: why} for a measurement that threw while the others ran), or
    {"status": "skipped"|"failed", "reason": ...} when the round could not run at all."""
    return node_json(JS_ROUND, JS_PACKAGES[runtime], [folder, threads, n_decode, *lengths], timeout=TIMEOUT)


def gguf_type(name: str) -> str:
    """The GGUF type an edgelin precision or variant (PRECISIONS, VARIANTS) is compared with."""
    return PRECISIONS[name] if name in PRECISIONS else VARIANTS[name][1]


def export_checked(ckpt: Path, out: Path, precision: str, trace_cache: Path | None = None) -> str:
    """``checkpoints.export_checked`` at a precision or a name of VARIANTS (its export options)."""
    return checkpoints.export_checked(ckpt, out, VARIANTS[precision][0] if precision in VARIANTS else precision, trace_cache)


def row_tests(measured: list[dict[str, float]], theirs: list[dict[str, float]], tests: list[str],
              failed: dict[str, str] | None = None) -> dict[str, Any]:
    """One row's figures: per test, edgelin's and llama.cpp's medians over their rounds and the ratio. edgelin's
    median is over the rounds that measured the test (a JavaScript round reports the measurements it finished); a
    test none did goes to "not_measured" with why (``failed``: test -> its runtime's error)."""
    out: dict[str, Any] = {}
    missing = {}
    for test in tests:
        ours = [r[test] for r in measured if test in r]
        if not ours:
            missing[test] = (failed or {}).get(test, "not measured")
            continue
        a, b = float(np.median(ours)), median_of(theirs, test)
        out[test] = {"edgelin_tokens_per_s": a, "llama_cpp_tokens_per_s": b, "edgelin_over_llama_cpp": a / b,
                     "edgelin_rounds": ours, "llama_cpp_rounds": [r[test] for r in theirs]}
    if missing:
        out["not_measured"] = missing
    return out


# ---- the section -------------------------------------------------------------------------------------
def llamacpp_section(plan: Plan, threads: int, say: Progress, *, models: dict[str, tuple[str, dict]] | None = None,
                     precisions: tuple[str, ...] | None = None, thread_counts: tuple[int, ...] | None = None,
                     runtimes: tuple[str, ...] = RUNTIMES) -> dict[str, Any]:
    """The section: every model of ``models`` (default MODELS: name -> (transformers model_type, config)) at every
    precision of ``precisions`` (default: all of PRECISIONS; names of VARIANTS too) with ``thread_counts`` threads (default 1, 2 and
    ``threads``), edgelin in each of ``runtimes`` (of RUNTIMES; a JavaScript runtime that cannot run here -- no node,
    no ``npm ci`` -- is recorded as skipped, with the reason, and the rest goes on); ``scripts/llamacpp_bench.py --model``
    runs it on a published configuration at real size."""
    unknown = sorted(set(runtimes) - set(RUNTIMES))
    if unknown or not runtimes:
        raise BenchError(f"runtimes: {', '.join(unknown) or 'none given'}; choose from {', '.join(RUNTIMES)}")
    src, why = find_llama_cpp()
    if src is None:
        return {"status": "skipped", "reason": why}
    from edgelin.upstream import greedy_agreement, run, unavailable

    if unavailable("transformers"):
        return {"status": "skipped", "reason": f"the checkpoints are built with transformers: {unavailable('transformers')}"}
    subjects = MODELS if models is None else models
    chosen = {p: gguf_type(p) for p in (precisions or PRECISIONS)}
    thread_counts = sorted(thread_counts or {1, 2, threads})
    bench_bin = binaries(src)["llama-bench"]
    tests = [f"tg{plan.llama_decode}", *(f"pp{L}" for L in plan.llama_lengths)]
    rng = np.random.default_rng(DATA_SEED)
    prompt = rng.integers(0, VOCAB, PROMPT, dtype=np.int64)
    rows, greedy, models, build_info, not_run, failed = [], {}, {}, {}, {}, {}
    load = {"start": load_average()}
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-llamacpp-") as tmp:
        work = Path(tmp)
        for name, (model_type, config) in subjects.items():
            say(f"llamacpp: {name}: transformers checkpoint, GGUF {'/'.join(dict.fromkeys(chosen.values()))}, edgelin {'/'.join(chosen)} ...")
            ckpt = build_checkpoint(name, work / name / "ckpt", subjects)
            ggufs = to_gguf(src, ckpt, work / name, tuple(dict.fromkeys(chosen.values())))
            checks = {}
            for p in chosen:
                say(f"  {name}: edgelin export at {p} ...")
                checks[p] = export_checked(ckpt, work / name / p, p, trace_cache=work / name / "traces")
            ref = run(ckpt, "transformers", prompt[None], np.zeros((1, 0), np.int64), greedy=GREEDY).greedy  # [1, GREEDY]
            models[name] = {"model_type": model_type, "config": config,
                            "parameters": sum(int(np.prod(s)) for s in _shapes(ckpt)),
                            "edgelin_export_check": checks, "gguf_bytes": {k: p.stat().st_size for k, p in ggufs.items()},
                            "edgelin_bytes": {p: sum(f.stat().st_size for f in (work / name / p).iterdir() if f.suffix in (".onnx", ".data")) for p in chosen}}
            greedy[name] = {"prompt": prompt.tolist(), "transformers": ref[0].tolist(), "edgelin": {}, "llama.cpp": {}}
            for p, kind in chosen.items():
                say(f"  {name} {p} / {kind}: greedy ids ...")
                sess = Session(work / name / p, "cpu", 1, session_options={"inter_op_num_threads": 1}, io_binding=True)
                for side, ids in (("edgelin", edgelin_greedy(sess, prompt, ref[0].tolist())),
                                  ("llama.cpp", llama_greedy(src, ggufs[kind], prompt, ref[0].tolist()))):
                    if ids["status"] == "ok":
                        frac, where = greedy_agreement(np.asarray([ids["ids"]]), ref)
                        ids = {**ids, "agreement": frac, "first_difference": where,
                               "forced_top1": float(np.mean(np.asarray(ids["forced_argmax"]) == ref[0]))}
                    greedy[name][side][p] = ids
                for T in thread_counts:
                    say(f"  {name} {p} / {kind}, {T} thread(s): {plan.llama_rounds} round(s) of llama-bench and edgelin "
                        f"({', '.join(runtimes)}), alternating ...")
                    sess = None
                    if "python" in runtimes:
                        sess = Session(work / name / p, "cpu", T, session_options={"inter_op_num_threads": 1}, io_binding=True)
                        edgelin_round(sess, plan.llama_decode, plan.llama_lengths, rng)  # warm-up (llama-bench warms up itself)
                    cmd = [bench_bin, "-m", ggufs[kind], "-t", T, "-p", ",".join(map(str, plan.llama_lengths)), "-n", plan.llama_decode,
                           "-r", 1, "-o", "json"]
                    sides = ("llama", *runtimes)
                    theirs, ours = [], {rt: [] for rt in runtimes}
                    for r in range(plan.llama_rounds):
                        for side in round_order(sides, r):
                            if side == "llama":
                                text = _run(cmd, "llama-bench")
                                theirs.append(parse_llama_bench(text))
                                build_info = build_info or {k: json.loads(text)[0].get(k) for k in ("build_commit", "build_number", "cpu_info", "backends")}
                            elif side == "python":
                                ours["python"].append(edgelin_round(sess, plan.llama_decode, plan.llama_lengths, rng))
                            elif (name, p, T, side) not in not_run:  # a JavaScript runtime, a node process per round
                                got = js_round(side, work / name / p, T, plan.llama_decode, plan.llama_lengths)
                                if "status" in got:
                                    not_run[name, p, T, side] = got
                                    say(f"    {side}: {got['status']}: {got['reason']}")
                                else:
                                    for test, why in got.pop("failed", {}).items():
                                        failed.setdefault((name, p, T, side), {})[test] = why
                                        say(f"    {side}: {test} failed: {why}")
                                    ours[side].append(got)
                    for runtime, measured in ours.items():
                        if not measured:
                            continue
                        row = {"model": name, "precision": p, "gguf": kind, "threads": T, "runtime": runtime, "rounds": len(measured),
                               "load_average": load_average()}
                        if runtime == "python":
                            row["io_binding"] = sess.io_binding
                        row.update(row_tests(measured, theirs, tests, failed.get((name, p, T, runtime))))
                        rows.append(row)
                        say(f"    {runtime}: " + ", ".join(f"{t} {row[t]['edgelin_over_llama_cpp']:.2f}x" if t in row else f"{t} not measured"
                                                       for t in tests) + " (edgelin / llama.cpp tokens/s)")
                sess = None
    load["end"] = load_average()
    return {
        "status": "ok",
        "what": "edgelin vs llama.cpp on the same transformers checkpoints (random weights, perturbed; byte-level tokenizer): "
                "tokens/s of decode (llama-bench tgN; edgelin: N Session.decode calls from an empty state, batch 1, IO binding "
                "where the state does not grow) and of prefill (llama-bench ppL; edgelin: one prefill of L tokens in the runtime's "
                "default pieces, the manifest's prefill_piece), "
                "edgelin per runtime (python: the Session; node / wasm: runtime/web/edgelin.mjs on onnxruntime-node / "
                "onnxruntime-web's WASM backend, the same calls, one node process per round), medians over rounds that "
                "alternate which goes first; ratio edgelin / llama.cpp (above 1: edgelin faster); "
                f"greedy ids after {PROMPT} prompt ids vs transformers' own model",
        "precisions": chosen, "threads": thread_counts, "runtimes": list(runtimes), "tests": tests, "models": models, "rows": rows,
        "runtimes_not_run": [{"model": m, "precision": p, "threads": t, "runtime": rt, **why} for (m, p, t, rt), why in not_run.items()],
        "greedy": greedy,
        "greedy_method": {"transformers": "edgelin.upstream.run: transformers' own model (fp32, triton/fla hidden), prefill then cached greedy decode",
                          "edgelin": "runtime Session: prefill of the prompt, then argmax of each decode call's logits, fed back",
                          "agreement": "fraction of the greedy ids before the first difference from transformers'",
                          "forced_top1": "fraction of steps whose argmax is transformers' id when transformers' greedy ids are fed "
                                         "instead of the engine's own (one early difference does not decide the rest)",
                          "llama.cpp": "the llama-cpp-python sdist's ctypes bindings on the build's libllama: llama_decode of the prompt ids "
                                       "in one batch, then argmax of llama_get_logits_ith(ctx, -1), fed back one token per llama_decode (1 thread)"},
        "conversion": "llama.cpp's convert_hf_to_gguf.py (pre-tokenizer declared gpt-2) to F32 and F16; llama-quantize F32 -> Q8_0, Q4_0 (default mix)",
        "versions": {**versions(src), **build_info, "onnxruntime": onnxruntime.__version__},
        "load_average": load,
    }


def _shapes(ckpt: Path) -> list[tuple[int, ...]]:
    from safetensors import safe_open

    shapes = []
    for part in sorted(ckpt.glob("*.safetensors")):  # one file, or the shards of a large checkpoint
        with safe_open(str(part), "np") as f:
            shapes += [tuple(f.get_slice(k).get_shape()) for k in f.keys()]
    return shapes


__all__ = ["ENV", "MODELS", "PRECISIONS", "RUNTIMES", "VARIANTS", "js_round", "gguf_type", "find_llama_cpp", "llamacpp_section", "parse_llama_bench",
           "row_tests"]
