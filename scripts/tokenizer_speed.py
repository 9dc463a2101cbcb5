"""Generation speed with a byte-level BPE tokenizer of 32,000 tokens, in the Python runtime and in headless Chromium.

    python scripts/tokenizer_speed.py [--vocab 32000] [--tokens 256] [--rounds 3] [--out FILE.json]

Trains a byte-level BPE tokenizer (the `tokenizers` package) on Python's standard library, gives a model of the
bundled model's shape (d_model 256, 4 layers, random weights) that vocabulary, exports it with the tokenizer, and
times greedy generation from a text prompt: `generate_text` (ONNX Runtime, CPU, 1 thread; text streamed through the
tokenizer's stream decoder) and the `edgelin web` page in headless Chromium (onnxruntime-web WASM, 1 thread,
@huggingface/tokenizers), rounds interleaved, medians reported. The page's text must equal Python's. Also the
stream decoder's own cost per token in Python. Needs `chromium` and the npm packages (npm ci).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "def read_config(path):\n    \"\"\"Read the configuration file"


def train_tokenizer(folder: Path, vocab: int) -> Path:
    import tokenizers as tk

    from edgelin.models.corpus import join, select

    text = join(select(heldout=False))[: 8 << 20].decode("utf-8", "replace")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))
    return folder


def chromium_run(chromium: str, site: Path, prompt: str, n: int, profile: Path, timeout: float = 300.0) -> dict:
    from edgelin.web import open_headless

    report = open_headless(chromium, site, {"prompt": prompt, "n": n}, profile, timeout)
    if report is None:
        sys.exit(f"the page reported nothing within {timeout:.0f} s")
    return report


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium is not installed (apt install chromium)")
    import torch

    from edgelin.checkpoint import load_config, save_checkpoint
    from edgelin.exporters import export
    from edgelin.model import LinearLM
    from edgelin.models import bundled_checkpoint
    from edgelin.runtime import generate_text, load
    from edgelin.runtime.tokenizer import make_tokenizer
    from edgelin.web import write_site

    with tempfile.TemporaryDirectory(prefix="edgelin-tok-speed-") as tmp:
        tmp = Path(tmp)
        say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        t0 = time.perf_counter()
        tokdir = train_tokenizer(tmp / "tok", args.vocab)
        say(f"trained a byte-level BPE tokenizer of {args.vocab:,} tokens in {time.perf_counter() - t0:.0f} s; exporting ...")
        cfg = load_config(bundled_checkpoint()).replace(vocab_size=args.vocab)
        torch.manual_seed(0)
        save_checkpoint(LinearLM(cfg).eval(), tmp / "ckpt")
        export(tmp / "ckpt", tmp / "export", tokenizer=tokdir)
        site = write_site(tmp / "export", tmp / "site").out_dir
        session = load(tmp / "export", provider="cpu", threads=1)
        python, page, texts = [], [], set()
        for r in range(args.rounds):
            g = generate_text(session, PROMPT, max_new_tokens=args.tokens)
            python.append(g)
            texts.add(g["text"])
            rep = chromium_run(chromium, site, PROMPT, args.tokens, tmp / f"profile{r}")
            if rep.get("state") != "done":
                sys.exit(f"the page failed: {rep.get('output')}")
            page.append(rep)
            say(f"round {r + 1}: Python {g['decode_tokens_per_s']:.0f} tok/s, Chromium {float(rep['decodeTokensPerS']):.0f} tok/s")
        same = {p["output"] for p in page} == texts and len(texts) == 1
        tok = make_tokenizer(session.manifest.tokenizer, tmp / "export", session.manifest.vocab_size)
        ids = python[0]["ids"]
        t0 = time.perf_counter()
        for _ in range(20):
            dec = tok.decoder()
            "".join(dec.feed(i) for i in ids) + dec.flush()
        feed_us = (time.perf_counter() - t0) / (20 * len(ids)) * 1e6
        res = {
            "vocab": args.vocab, "tokens": args.tokens, "prompt_tokens": python[0]["prompt_tokens"],
            "python_decode_tokens_per_s": statistics.median(p["decode_tokens_per_s"] for p in python),
            "python_prefill_tokens_per_s": statistics.median(p["prefill_tokens_per_s"] for p in python),
            "chromium_decode_tokens_per_s": statistics.median(float(p["decodeTokensPerS"]) for p in page),
            "chromium_prefill_tokens_per_s": statistics.median(float(p["prefillTokensPerS"]) for p in page),
            "python_stream_decoder_us_per_token": feed_us, "page_text_equals_python": same,
            "text_chars": len(python[0]["text"]),
        }
        print(json.dumps(res, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
