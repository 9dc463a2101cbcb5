"""The whole product on each Hugging Face family: export at every precision, validate, generate, chat, the browser, bench.

    python scripts/hf_product_check.py [--families qwen3_5,lfm2,...] [--out docs/bench/hf_product.json] [--keep DIR]

For each model of ``edgelin.bench.checkpoints.FAMILIES`` (one per importer family, the bundled model's weight
size, random weights, a 512-token byte-level BPE tokenizer, all built and saved by transformers' own classes; a small
chat template is added to its tokenizer_config.json):

    export     fp32, fp16, int8, int4 (``edgelin export``'s check against PyTorch on)
    validate   every check of each export against the checkpoint; at fp32 also against transformers itself
               (``upstream="required"``: its own model, prefill, cached decode and greedy ids)
    generate   greedy ids from a text prompt, edgelin's ``generate_text`` vs transformers' ``generate`` (fp32)
    chat       the first turn of ``Chat`` vs transformers' ``generate`` on ``apply_chat_template`` (fp32, text equal)
    web        ``edgelin web``'s site in headless Chromium (onnxruntime-web, WASM): its greedy text vs the Python
               runtime's (needs chromium and ``npm ci``; said and skipped where either is missing)
    bench      ``edgelin bench EXPORT --quick --section decode`` on the fp32 export

transformers runs in this process with triton and fla hidden (its PyTorch paths, as on a CPU-only device).
Writes the record (--out) atomically and prints one line per family.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.modules["triton"] = None  # type: ignore[assignment]  # transformers' PyTorch paths
sys.modules["fla"] = None  # type: ignore[assignment]

TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
PRECISIONS = ("fp32", "fp16", "int8", "int4")
N = 16


def add_template(ckpt: Path) -> None:
    path = ckpt / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = TEMPLATE
    path.write_text(json.dumps(cfg, indent=2))


def check_family(name: str, work: Path) -> dict:
    import torch
    import transformers

    from edgelin.bench import run_bench
    from edgelin.bench.checkpoints import FAMILIES as MODELS, build_checkpoint, export_checked
    from edgelin.bench.transformers_eager import TEXT
    from edgelin.runtime import generate_text
    from edgelin.runtime.chat import Chat
    from edgelin.runtime.session import Session
    from edgelin.validate import validate

    row: dict = {"model_type": MODELS[name][0]}
    t0 = time.perf_counter()
    ckpt = build_checkpoint(name, work / "ckpt", MODELS)
    add_template(ckpt)
    exports = {}
    for p in PRECISIONS:
        out = work / p
        started = time.perf_counter()
        row[f"export_{p}"] = export_checked(ckpt, out, p, trace_cache=work / "traces")  # one trace, every precision
        exports[p] = out
        report = validate(out, ckpt, steps=16, long=0, upstream="required" if p == "fp32" else "off")
        failed = [f"{c.group}: {c.name}" for c in report.checks if c.failed]
        row[f"validate_{p}"] = {"passed": report.passed, "checks": sum(c.status == "pass" for c in report.checks), "failed": failed,
                                "upstream": sum(c.group == "upstream" and c.status == "pass" for c in report.checks),
                                "seconds": round(time.perf_counter() - started, 1)}

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    prompt = tok(TEXT, return_tensors="pt")
    with torch.inference_mode():
        hf = model.generate(**prompt, max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, prompt["input_ids"].shape[1]:].tolist()
    mine = generate_text(exports["fp32"], TEXT, max_new_tokens=N, min_new_tokens=N, provider="cpu", threads=1)
    row["generate_ids_equal"] = list(mine["ids"]) == hf

    messages = [{"role": "user", "content": "Hello there, what is a stack?"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        hf_chat = model.generate(**chat_ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)[0, chat_ids["input_ids"].shape[1]:]
    chat = Chat(Session(exports["fp32"], "cpu", 1))
    reply = chat.send(messages[0]["content"], max_new_tokens=N, min_new_tokens=N)
    row["chat_text_equal"] = reply == tok.decode(hf_chat, skip_special_tokens=True)

    row["web"] = web_check(exports["fp32"], work, mine["text"])
    bench = run_bench(exports["fp32"], sections=["decode"], quick=True, threads=1, out_dir=work / "bench", plots=False)
    decode = json.loads(bench.json_path.read_text())["decode"]
    row["bench_decode_ms_batch1"] = {k: v["median"] for k, v in decode["batches"]["1"].items() if k != "ratios"}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def web_check(export: Path, work: Path, want: str) -> dict:
    from edgelin.errors import EdgelinError
    from edgelin.web import find_ort_web, open_headless, write_site

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return {"status": "skipped", "reason": "no chromium on PATH"}
    try:
        ort_web = find_ort_web()
    except EdgelinError as exc:
        return {"status": "skipped", "reason": str(exc)}
    from edgelin.bench.transformers_eager import TEXT

    site = write_site(export, work / "site", ort_web=ort_web).out_dir
    report = open_headless(chromium, site, {"prompt": TEXT, "n": N}, work / "profile")
    if report is None:
        return {"status": "failed", "reason": "the page reported nothing"}
    return {"status": report["state"], "text_equal": report["output"] == want, "decode_tokens_per_s": float(report["decodeTokensPerS"])}


def main() -> int:
    from edgelin.bench.checkpoints import FAMILIES as MODELS
    from edgelin.runtime.files import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--out", type=Path, default=None, help="write the record here (JSON)")
    ap.add_argument("--keep", type=Path, default=None, help="build in this folder (kept) instead of a temporary one")
    args = ap.parse_args()
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown family {unknown[0]!r}; choose from {', '.join(MODELS)}")
    record = {"command": "python scripts/hf_product_check.py " + " ".join(sys.argv[1:]), "families": {}}
    with tempfile.TemporaryDirectory(prefix="edgelin-hf-product-") as tmp:
        root = args.keep or Path(tmp)
        for name in names:
            print(f"{name}: ...", file=sys.stderr, flush=True)
            row = check_family(name, root / name)
            record["families"][name] = row
            print(json.dumps({name: row}), flush=True)
            if args.out:  # after each family: a long run stopped early keeps what it measured
                write_json(args.out, record, overwrite=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
