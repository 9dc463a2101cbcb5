"""The ``transformers`` section: each Hugging Face family's export against transformers' own eager model on CPU.

Opt-in (``--section transformers``; skipped, with the reason, without transformers). For each model of ``MODELS``
(one per importer family: Qwen3.5, Qwen3-Next with dense MLPs, LFM2, Mamba2, Bamba, Granite-4.0-H; each of the
bundled model's weight size, hidden 256 and 4 layers, in its family's layer pattern; random weights perturbed so the
logits spread, saved with a byte-level BPE tokenizer of 512 tokens, built and saved by transformers' own classes in a
subprocess, as the llamacpp section's are) the checkpoint is exported at fp32 with the exporter's check against
PyTorch, then one worker process (``python -m edgelin.bench --hf-eager SPEC``, triton and fla hidden so that
transformers takes its PyTorch paths, as on a CPU-only device) holds both engines with the same thread count:

    transformers  ``AutoModelForCausalLM.from_pretrained`` (float32, eval, ``inference_mode``), its ``DynamicCache``
    edgelin       the runtime ``Session`` of the export (CPU provider, IO binding where the state does not grow)

and measures, in ``plan.hf_rounds`` rounds whose order alternates: decode (N single-token calls from an empty
state / an empty cache, batch 1: ms per token = their total time / N) and prefill (one call of L tokens, batch 1:
tokens/s). Reported: medians over the rounds and transformers / edgelin (above 1, edgelin is faster).

Greedy ids from a text prompt: the prompt encoded by transformers' tokenizer and by the export's (the ids must be
equal), then ``GREEDY`` new tokens from transformers' ``generate`` (greedy, ``min_new_tokens`` = ``max_new_tokens`` so
an end-of-sequence id cannot cut one side short) and from edgelin's ``generate_text`` with the same settings.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoints import FAMILIES, VOCAB, build_checkpoint, export_checked
from .harness import alternating, load_average, median_of, run_command
from .plan import DATA_SEED, BenchError, Plan, Progress

MODELS = FAMILIES  # one checkpoint per importer family
TEXT = "The quick brown fox jumps over the lazy dog. def area(r): return 3.14159 * r * r"
GREEDY = 16
WORKER_TIMEOUT = 1800.0  # seconds for one model's worker
POSITIONS_PASSED = ("bamba", "granitemoehybrid")  # their models count positions from 0 on each call unless told


# ---- the worker (transformers and edgelin's runtime in one process) ------------------------------------
def hf_eager_main(spec: dict[str, Any]) -> None:
    """In ``python -m edgelin.bench --hf-eager SPEC``: the measurements of one model, printed as JSON."""
    sys.modules["triton"] = None  # type: ignore[assignment]  # transformers' PyTorch paths (a CPU-only device)
    sys.modules["fla"] = None  # type: ignore[assignment]
    import torch
    import transformers

    from edgelin.runtime.generate import generate_text
    from edgelin.runtime.session import Session

    threads, n_decode, lengths = spec["threads"], spec["decode"], spec["lengths"]
    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32).eval()
    sess = Session(spec["export"], "cpu", threads, session_options={"inter_op_num_threads": 1}, io_binding=True)
    positions = spec["model_type"] in POSITIONS_PASSED
    rng = np.random.default_rng(DATA_SEED)
    clock = time.perf_counter

    def hf_decode(ids: np.ndarray) -> float:
        cache, total = transformers.DynamicCache(config=model.config), 0.0
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                kw = {"position_ids": torch.tensor([[t]])} if positions else {}
                t0 = clock()
                model(torch.from_numpy(ids[:, t : t + 1]), cache=cache, use_cache=True, **kw)
                total += clock() - t0
        return total

    def ort_decode(ids: np.ndarray) -> float:
        state, total = sess.new_state(1), 0.0
        for t in range(ids.shape[1]):
            t0 = clock()
            sess.decode(ids[:, t : t + 1], state)
            total += clock() - t0
        return total

    def hf_prefill(ids: np.ndarray) -> float:
        with torch.inference_mode():
            t0 = clock()
            # the last position's logits only, as generate() asks and as edgelin's runtime prefills a prompt
            model(torch.from_numpy(ids), cache=transformers.DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
            return clock() - t0

    def ort_prefill(ids: np.ndarray) -> float:
        state = sess.new_state(1)
        t0 = clock()
        sess.prefill(ids, state, chunk=ids.shape[1], last_only=True)
        return clock() - t0

    engines = {"transformers": (hf_decode, hf_prefill), "edgelin": (ort_decode, ort_prefill)}
    warm = rng.integers(0, VOCAB, (1, 8), dtype=np.int64)
    for decode, prefill in engines.values():  # one untimed call of each kind
        decode(warm), prefill(warm)
    inputs = [(rng.integers(0, VOCAB, (1, n_decode), dtype=np.int64), {L: rng.integers(0, VOCAB, (1, L), dtype=np.int64) for L in lengths})
              for _ in range(spec["rounds"])]  # each round's ids, the same for both engines

    def measure(name: str, r: int) -> dict[str, float]:
        (decode, prefill), (dec, pre) = engines[name], inputs[r]
        return {"decode_ms": 1e3 * decode(dec) / n_decode, **{f"prefill_{L}_tokens_per_s": L / prefill(pre[L]) for L in lengths}}

    rounds = alternating({name: (lambda r, name=name: measure(name, r)) for name in engines}, spec["rounds"])

    tok = transformers.AutoTokenizer.from_pretrained(spec["ckpt"])
    prompt = tok(TEXT, return_tensors="pt")
    with torch.inference_mode():
        hf_ids = model.generate(**prompt, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False)[0, prompt["input_ids"].shape[1]:]
    mine = generate_text(sess, TEXT, max_new_tokens=GREEDY, min_new_tokens=GREEDY)
    mine_prompt = list(sess.tokenizer.encode(TEXT))
    print(json.dumps({
        "rounds": rounds, "threads": threads, "io_binding": sess.io_binding, "torch": torch.__version__,
        "transformers": transformers.__version__,
        "greedy": {"text": TEXT, "prompt_ids": prompt["input_ids"][0].tolist(),
                   "prompt_ids_equal": mine_prompt == prompt["input_ids"][0].tolist(),
                   "transformers": hf_ids.tolist(), "edgelin": list(mine["ids"]), "equal": hf_ids.tolist() == list(mine["ids"])},
    }))


# ---- the section -----------------------------------------------------------------------------------------
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    out = run_command([sys.executable, "-m", "edgelin.bench", "--hf-eager", json.dumps(spec)], "the transformers-vs-edgelin worker", BenchError,
                      WORKER_TIMEOUT)
    return json.loads(out.strip().splitlines()[-1])


def transformers_section(plan: Plan, threads: int, say: Progress) -> dict[str, Any]:
    from edgelin.upstream import unavailable

    if unavailable("transformers"):
        return {"status": "skipped", "reason": unavailable("transformers")}
    names = [n for n in MODELS if n in plan.hf_models]
    rows, greedy = [], {}
    load = {"start": load_average()}
    with tempfile.TemporaryDirectory(prefix="edgelin-bench-transformers-") as tmp:
        work = Path(tmp)
        for name in names:
            model_type, _ = MODELS[name]
            say(f"transformers: {name}: checkpoint ({model_type}), fp32 export, then decode {plan.hf_decode} tokens and prefill "
                f"{', '.join(map(str, plan.hf_lengths))} tokens x {plan.hf_rounds} rounds, transformers eager vs edgelin ...")
            ckpt = build_checkpoint(name, work / name / "ckpt", MODELS)
            check = export_checked(ckpt, work / name / "export", "fp32")
            got = _worker({"ckpt": str(ckpt), "export": str(work / name / "export"), "model_type": model_type, "threads": threads,
                           "decode": plan.hf_decode, "lengths": list(plan.hf_lengths), "rounds": plan.hf_rounds})
            hf, mine = got["rounds"]["transformers"], got["rounds"]["edgelin"]
            row = {"model": name, "model_type": model_type, "export_check": check, "threads": threads, "io_binding": got["io_binding"],
                   "decode_ms": {"transformers": median_of(hf, "decode_ms"), "edgelin": median_of(mine, "decode_ms")}, "prefill_tokens_per_s": {}}
            row["decode_transformers_over_edgelin"] = row["decode_ms"]["transformers"] / row["decode_ms"]["edgelin"]
            for L in plan.hf_lengths:
                key = f"prefill_{L}_tokens_per_s"
                row["prefill_tokens_per_s"][str(L)] = {"transformers": median_of(hf, key), "edgelin": median_of(mine, key)}
            row["prefill_edgelin_over_transformers"] = {
                str(L): v["edgelin"] / v["transformers"] for L, v in row["prefill_tokens_per_s"].items()}
            rows.append(row)
            greedy[name] = got["greedy"]
            versions = {"torch": got["torch"], "transformers": got["transformers"]}
    load["end"] = load_average()
    return {
        "status": "ok",
        "what": "each Hugging Face family's export (fp32) against transformers' own eager model with its DynamicCache on CPU, "
                "one worker process, same threads, rounds alternating which goes first; decode: ms per token over N "
                "single-token calls from an empty state, batch 1; prefill: one call of L tokens, tokens/s; medians",
        "models": {n: {"model_type": MODELS[n][0], "config": MODELS[n][1]} for n in names}, "rounds": plan.hf_rounds,
        "decode_tokens": plan.hf_decode, "lengths": list(plan.hf_lengths), "rows": rows, "greedy": greedy,
        "versions": versions if rows else {}, "load_average": load,
    }


__all__ = ["GREEDY", "MODELS", "TEXT", "hf_eager_main", "transformers_section"]
