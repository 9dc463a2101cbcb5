"""The ``fla`` section: a flash-linear-attention checkpoint, imported and exported by edgelin, next to fla's own model.

A tiny random ``LinearAttentionForCausalLM`` (``FLA_MODEL``, fla's defaults otherwise: the learned
``elementwise_product`` feature map, no denominator) is built with the real fla package and saved with
``save_pretrained``. Then, in one process:

    import + export   wall time of ``load_checkpoint(PATH)`` (edgelin's fla importer) and of ``export(model, OUT)``
                      (both graphs, their check against PyTorch, the manifest); each repeat exports to a fresh
                      folder; the first repeat pays torch.onnx's one-off warm-up and is reported apart
    decode            ms per token, batch 1, interleaved in rotating rounds: the ONNX decode graph through the
                      runtime's Session (IO binding), the imported model's PyTorch eager ``step``, and fla's own
                      cached step (``model(token, past_key_values=cache)``)

fla's kernels are written in Triton, which has no CPU backend: on a machine without a GPU fla runs only in
Triton's interpreter (``TRITON_INTERPRET=1``, numpy underneath), with the autotuner made to keep the config
with the largest blocks (it would otherwise benchmark candidates on a GPU; ``edgelin.upstream_run``). So fla's
step here measures fla *as it runs on a CPU*, not its GPU speed; the report says so. fla is loaded with ``attn_mode="fused_recurrent"`` (the kernels
the interpreter runs) and, by default, ``fuse_norm=False, fuse_swiglu=False`` (RMSNorm and SwiGLU in PyTorch,
the same math without two more interpreted kernels per layer: fla's fastest CPU configuration).

Before anything is timed, the three decode paths are fed the same tokens from an empty state and their logits
compared (ONNX vs the import: the fp32 "logits" budget of ``edgelin.parity``; the import vs fla: max abs
``FLA_MAX_ABS``, the importer tests' budget); a disagreement fails the section and nothing is timed.

Everything runs in a worker process (``python -m edgelin.bench --foreign SPEC_JSON``): the interpreter is
chosen by an environment variable read when Triton defines a kernel, and the autotuner patch is global, so
neither may touch the caller's process. Without fla (or triton) the section is skipped, with the reason.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from edgelin.runtime.files import write_json

from .checkpoints import perturb
from .harness import dist_version, interleaved, ratio, stats
from .plan import DATA_SEED, MODEL_SEED, BenchError, Plan, Progress

# The fla model measured: tiny, fla's defaults otherwise. Vocabulary of bytes, like the bundled model.
FLA_MODEL = {"hidden_size": 128, "num_hidden_layers": 2, "num_heads": 4, "vocab_size": 256}
FLA_MAX_ABS = 1e-4  # import vs fla, max abs logits (fp32): the budget of the importer's tests against fla
CHECK_STEPS = 4  # tokens fed to all three decode paths before timing
PROGRESS = "progress: "  # the worker's progress lines on stdout start with this
INSTALL_HINT = "pip install -e '.[test]' installs flash-linear-attention and triton"


# ---- the parent side ------------------------------------------------------------------------------
def fla_section(plan: Plan, threads: int, say: Progress, fused: bool = False) -> dict[str, Any]:
    """Run the fla section in a worker process; its JSON part, or {"status": "skipped", "reason": ...}.
    BenchError if the worker fails or the decode paths disagree."""
    say("fla: build a flash-linear-attention model, import + export it, decode vs fla (Triton interpreter) ...")
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-fla-") as work:
        result_file = Path(work) / "result.json"
        spec = {"work": work, "result": str(result_file), "threads": threads, "fused": fused,
                "export_repeats": plan.fla_export_repeats, "warmup": plan.fla_warmup, "rounds": plan.fla_rounds,
                "per_round": plan.fla_per_round}
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=str(threads))
        log_path = Path(work) / "worker.log"
        with open(log_path, "w+", encoding="utf-8") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgelin.bench", "--foreign", json.dumps(spec)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            watchdog = threading.Timer(plan.fla_time_cap_s, proc.kill)  # the stdout loop below blocks until the worker ends
            watchdog.start()
            try:
                for line in proc.stdout:
                    if line.startswith(PROGRESS):
                        say("  " + line[len(PROGRESS):].rstrip())
                code = proc.wait()
            finally:
                timed_out = not watchdog.is_alive() and proc.returncode is not None and proc.returncode < 0
                watchdog.cancel()
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            if timed_out:
                raise BenchError(f"the fla section took more than {plan.fla_time_cap_s:.0f} s and was stopped; nothing was reported")
            if code != 0 or not result_file.is_file():
                log.seek(0)
                lines = [x.strip() for x in log.read().splitlines() if x.strip()]
                raise BenchError(f"the fla section failed: {(lines or [f'exit status {code}'])[-1][:300]}")
        result = json.loads(result_file.read_text(encoding="utf-8"))
    if result["status"] == "disagree":
        raise BenchError(f"the fla section's decode paths disagree: {result['reason']}; nothing was timed")
    return result


# ---- the worker -----------------------------------------------------------------------------------
def _fla_models():
    """fla.models with Triton's interpreter set up as validate's upstream run sets it (one autotuner config, the
    largest blocks: ``edgelin.upstream_run.interpret_on_cpu``), or the reason it cannot be imported."""
    warnings.filterwarnings("ignore", message=".*Triton is not supported on current platform.*")
    try:
        models = importlib.import_module("fla.models")
        from edgelin.upstream_run import interpret_on_cpu

        interpret_on_cpu()
    except Exception as exc:  # noqa: BLE001 -- ImportError, or triton failing at import: said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return None, f"flash-linear-attention cannot be imported ({type(exc).__name__}: {first}); {INSTALL_HINT}"
    return models, None


def _build(models, folder: Path):
    """A random fla model saved to ``folder``; weights perturbed so the logits spread over a few units (fla's
    own init gives near-constant logits, against which a parity check would prove little)."""
    import torch

    cfg = models.LinearAttentionConfig(**FLA_MODEL)
    torch.manual_seed(MODEL_SEED)
    model = models.LinearAttentionForCausalLM(cfg).eval()
    perturb(model, MODEL_SEED + 1, lambda name: "embeddings" in name or "lm_head" in name)
    model.save_pretrained(folder)
    return cfg


def foreign_worker_main(spec: dict[str, Any]) -> None:
    """The fla section, in this (fresh) process; writes its JSON part to ``spec["result"]``."""
    def say(msg: str) -> None:
        print(PROGRESS + msg, flush=True)

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the fla worker needs TRITON_INTERPRET=1 in its environment (set by the bench)")
    models, why = _fla_models()
    if models is None:
        write_json(Path(spec["result"]), {"status": "skipped", "reason": why})
        return
    import numpy as np
    import torch

    from edgelin import parity
    from edgelin.checkpoint import load_checkpoint
    from edgelin.exporters import export
    from edgelin.runtime.session import Session
    from edgelin.state import fresh_state

    threads = spec["threads"]
    torch.set_num_threads(threads)
    work = Path(spec["work"])
    folder = work / "fla-checkpoint"
    say(f"building fla LinearAttentionForCausalLM {FLA_MODEL} and saving it ...")
    cfg = _build(models, folder)

    # import + export, each repeat into a fresh folder
    say(f"import + export x{spec['export_repeats']} ...")
    runs = []
    for r in range(spec["export_repeats"]):
        t0 = time.perf_counter()
        imported = load_checkpoint(folder).float().eval()
        t1 = time.perf_counter()
        result = export(imported, work / f"export-{r}", check=True)
        t2 = time.perf_counter()
        runs.append({"import_s": t1 - t0, "export_s": t2 - t1, "total_s": t2 - t0, "graphs_s": dict(result.seconds)})
        say(f"  import {t1 - t0:.2f} s, export {t2 - t1:.1f} s")
    later = runs[1:] or runs
    timing = {"first": runs[0], "runs": runs,
              "median_after_first": {k: float(np.median([x[k] for x in later])) for k in ("import_s", "export_s", "total_s")}}

    # fla's own model, on the kernels Triton's interpreter runs
    overrides = {} if spec["fused"] else {"fuse_norm": False, "fuse_swiglu": False}
    fla_model = models.LinearAttentionForCausalLM.from_pretrained(folder, attn_mode="fused_recurrent", **overrides).eval()
    sess = Session(work / "export-0", "cpu", threads, session_options={"inter_op_num_threads": 1}, io_binding=True)
    specs = imported.state_specs()

    rng = np.random.default_rng(DATA_SEED)
    vocab = FLA_MODEL["vocab_size"]
    say(f"checking the three decode paths on {CHECK_STEPS} tokens ...")
    check_ids = rng.integers(0, vocab, (1, CHECK_STEPS), dtype=np.int64)  # [1, n]
    worst = {"ort_vs_import": parity.NONE, "import_vs_fla": parity.NONE}
    with torch.inference_mode():
        state, ort_state, cache = fresh_state(specs, 1), sess.new_state(1), None
        for t in range(CHECK_STEPS):
            tok = check_ids[:, t:t + 1]  # [1, 1]
            ours, state = imported.step(torch.from_numpy(tok), state)
            got = sess.decode(tok, ort_state)
            out = fla_model(torch.from_numpy(tok), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            worst["ort_vs_import"] = worst["ort_vs_import"].worst(parity.errors(got, ours.numpy()))
            worst["import_vs_fla"] = worst["import_vs_fla"].worst(parity.errors(ours.numpy(), out.logits.float().numpy()))
    budgets = {"ort_vs_import": parity.budget("fp32", "logits"), "import_vs_fla": {"max_abs": FLA_MAX_ABS}}
    check = {"steps": CHECK_STEPS, "budgets": budgets, "errors": {k: vars(e) for k, e in worst.items()}}
    bad = [k for k in worst if not parity.within(worst[k], budgets[k])]
    if bad:
        reason = ", ".join(f"{k} max abs {worst[k].max_abs:.2e}, rel L2 {worst[k].rel_l2:.2e} (budget {budgets[k]})" for k in bad)
        write_json(Path(spec["result"]), {"status": "disagree", "reason": reason, "check": check})
        return
    say("  " + ", ".join(f"{k} {e.max_abs:.1e}" for k, e in worst.items()) + " (logits max abs): ok")

    # decode, interleaved: every contender carries its own state over the timed calls
    say("decode, batch 1: ORT IO binding vs imported eager step vs fla's step (interpreter) ...")
    tok = rng.integers(0, vocab, (1, 1), dtype=np.int64)  # [1, 1]
    tok_t = torch.from_numpy(tok)
    holder = {"torch": fresh_state(specs, 1), "ort": sess.new_state(1), "fla": None}

    def ort_bind():
        sess.decode(tok, holder["ort"])

    def eager():
        holder["torch"] = imported.step(tok_t, holder["torch"])[1]

    def fla_step():
        holder["fla"] = fla_model(tok_t, past_key_values=holder["fla"], use_cache=True).past_key_values

    with torch.inference_mode():
        samples = interleaved({"ort_iobinding": ort_bind, "torch_eager": eager, "fla_step": fla_step},
                              warmup=spec["warmup"], rounds=spec["rounds"], per_round=spec["per_round"])
    decode = {name: stats(s) for name, s in samples.items()}
    for row in decode.values():
        row["tokens_per_s"] = 1 / (row["median"] / 1e3)
    decode["ratios"] = {"fla_step_over_ort_iobinding": ratio(decode["fla_step"], decode["ort_iobinding"]),
                        "fla_step_over_torch_eager": ratio(decode["fla_step"], decode["torch_eager"]),
                        "torch_eager_over_ort_iobinding": ratio(decode["torch_eager"], decode["ort_iobinding"])}

    import triton

    write_json(Path(spec["result"]), {
        "status": "ok",
        "what": "a tiny random flash-linear-attention LinearAttentionForCausalLM (fla's defaults otherwise), saved with "
                "save_pretrained: edgelin's import + export wall time, and decode ms per token at batch 1 of its ONNX "
                "decode graph vs the imported model's PyTorch eager step vs fla's own cached step",
        "fla_config": {**FLA_MODEL, "feature_map": cfg.feature_map, "intermediate_size": cfg.intermediate_size,
                       "hidden_ratio": cfg.hidden_ratio, "norm_feature_map": cfg.norm_feature_map},
        "parameters": sum(p.numel() for p in imported.parameters()),
        "provider": "cpu", "threads": threads,
        "versions": {"fla": dist_version("flash-linear-attention", "fla-core"), "triton": triton.__version__},
        "import_export": timing,
        "decode_nodes": result.nodes.get("decode"), "prefill_nodes": result.nodes.get("prefill"),
        "state_bytes_per_sequence": sess.manifest.state_bytes(1),
        "check": check,
        "contenders": {
            "ort_iobinding": "the export's decode graph through edgelin.runtime Session (IO binding, state buffers reused)",
            "torch_eager": "the imported model's step (edgelin.skeleton.CausalLM), PyTorch eager, inference_mode",
            "fla_step": "fla's LinearAttentionForCausalLM cached step, attn_mode='fused_recurrent'"
                        + ("" if spec["fused"] else ", fuse_norm=False, fuse_swiglu=False")
                        + ": fla's Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1; Triton has no CPU "
                          "backend, so this is the only way fla runs on a CPU: not fla's GPU speed)",
        },
        "decode": decode,
    })


__all__ = ["FLA_MODEL", "fla_section", "foreign_worker_main"]
