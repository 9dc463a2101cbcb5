"""The main job, end to end: export the bundled model, validate it, stream text from ONNX Runtime, summarise."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from edgelin.config import ModelConfig
from edgelin.errors import EdgelinError
from edgelin.runtime.files import check_output_dir

DEFAULT_PROMPTS = ("def fibonacci(n):", "The for statement is used to")  # a code and a prose continuation
# Seeded sampling: greedy decoding of a small byte-level model falls into loops; a moderate temperature with
# a nucleus keeps it on real tokens without repeating itself (models/stdlib-linear/README.md shows the output).
# Left alone, the model falls into runs of spaces after a block opener (seed 0 of "class Stack:": 199 spaces). The
# defaults stop that with Hugging Face's no_repeat_ngram_size: no 16 bytes occur twice in a row, so a run of spaces
# ends at 16 (four indentation levels). Measured with scripts/demo_space_runs.py (8 prompts x 15 seeds x 200 tokens
# at temperature 0.7, top-p 0.9): outputs with a run of 40+ spaces 33 of 120 at 0 (off), 0 at 16, 24 and 32; with a
# run of 17+ 37 at 0, 0 at 16, 39 at 24. Its cost: a repeated 16-byte piece of a code line is banned too (the
# second "        self.asse" must differ somewhere). The repetition penalty is off: on this byte-level model every
# common byte is "already seen", so it pushes prose toward rare bytes (runs of 40+ spaces 13/60 at 1.0, 4 at 1.3,
# 0 at 1.5 over 5 prompts x 12 seeds, but the prose prompt turned into code in 0, 2 and 6 of 8 seeds).
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 16}
LONG_CONTEXT = 100_000


@dataclass
class DemoSummary:
    export_dir: str
    parity: str  # "PASS" / "FAIL"
    checks: str  # "13 passed, 0 failed"
    provider: str
    prompt_tokens: int  # over every prompt
    new_tokens: int
    longest: int  # tokens of the longest sequence (prompt + continuation)
    time_to_first_token_s: float
    decode_tokens_per_s: float
    state_bytes: int  # per sequence, constant
    kv_bytes_now: int  # a same-size softmax model's fp32 KV cache at this length
    kv_bytes_100k: int

    def lines(self) -> list[str]:
        n = self.longest
        return [
            f"parity (ONNX Runtime vs PyTorch): {self.parity} ({self.checks})",
            f"provider: {self.provider}   time to first token: {self.time_to_first_token_s * 1e3:.1f} ms   "
            f"decode: {self.decode_tokens_per_s:,.0f} tokens/s",
            f"state per sequence: {_mb(self.state_bytes)} at any length; a softmax KV cache of the same model: "
            f"{_mb(self.kv_bytes_now)} at {n:,} tokens, {_mb(self.kv_bytes_100k)} at {LONG_CONTEXT:,} tokens",
            f"export: {self.export_dir}",
        ]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def run_demo(
    prompts: str | Sequence[str] = DEFAULT_PROMPTS,
    out_dir: str | Path | None = None,
    *,
    max_new_tokens: int = 200,
    temperature: float = DEFAULT_SAMPLING["temperature"],
    top_p: float = DEFAULT_SAMPLING["top_p"],
    seed: int = DEFAULT_SAMPLING["seed"],
    repetition_penalty: float = DEFAULT_SAMPLING["repetition_penalty"],
    no_repeat_ngram_size: int = DEFAULT_SAMPLING["no_repeat_ngram_size"],
    provider: str = "auto",
    on_text: Callable[[int, str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoSummary:
    """Export the bundled model, validate it, continue each prompt from ONNX Runtime (``on_text(i, text)``
    receives prompt i's continuation piece by piece), and summarise."""
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint
    from edgelin.runtime import Manifest, generate_text, load
    from edgelin.validate import validate

    say = progress or (lambda _m: None)
    checkpoint = bundled_checkpoint()
    if checkpoint is None:
        raise EdgelinError("this install has no bundled model (edgelin/models/stdlib-linear); reinstall edgelin")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts or not all(prompts):
        raise EdgelinError("a prompt is empty; pass --prompt with some text")
    from edgelin.runtime.generate import _check_options  # the sampling options, checked before half a minute of export
    from edgelin.runtime.sampling import Sampler

    _check_options(max_new_tokens, 1, [], repetition_penalty, 0, no_repeat_ngram_size)
    Sampler(temperature=temperature, top_p=top_p, seed=seed)
    if out_dir is not None:  # before any work; only an empty folder or an edgelin export is ever replaced
        check_output_dir(out_dir, force=True, protect=(checkpoint,), flag="--out")
    tmp = None
    if out_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="edgelin-demo-"))
        out = tmp / "export"
    else:
        out = Path(out_dir)
    try:
        say(f"[1/3] exporting the bundled model {checkpoint.name} ...")
        export(checkpoint, out, force=out_dir is not None, progress=lambda m: say(f"      {m}"))
        say("[2/3] validating the export (ONNX Runtime vs PyTorch) ...")
        report = validate(out, checkpoint, steps=16)
        counts = {s: sum(c.status == s for c in report.checks) for s in ("pass", "fail")}
        say(f"      {'PASS' if report.passed else 'FAIL'}: {counts['pass']} checks passed, {counts['fail']} failed")
        say(f"[3/3] generating from ONNX Runtime (temperature {temperature}, top-p {top_p}, seed {seed}, "
            f"repetition penalty {repetition_penalty}, no repeated {no_repeat_ngram_size}-grams): "
            + ", ".join(repr(p) for p in prompts))
        session, results = load(out, provider=provider), []  # loaded once for every prompt
        for i, prompt in enumerate(prompts):
            stream = None if on_text is None else (lambda text, i=i: on_text(i, text))
            results.append(generate_text(session, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                         seed=seed, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                                         on_text=stream))
        manifest = Manifest.load(out)
        cfg = ModelConfig.from_dict(manifest.model)
        total = max(r["prompt_tokens"] + r["new_tokens"] for r in results)
        decode_tokens, decode_s = sum(r["decode_tokens"] for r in results), sum(r["decode_s"] for r in results)
        return DemoSummary(
            export_dir=str(out) if tmp is None else "(temporary; pass --out DIR to keep it)",
            parity="PASS" if report.passed else "FAIL",
            checks=f"{counts['pass']} passed, {counts['fail']} failed",
            provider=results[0]["provider"],
            prompt_tokens=sum(r["prompt_tokens"] for r in results),
            new_tokens=sum(r["new_tokens"] for r in results),
            longest=total,
            time_to_first_token_s=results[0]["time_to_first_token_s"],
            decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else 0.0,
            state_bytes=manifest.state_bytes(1),
            kv_bytes_now=cfg.kv_cache_bytes(total),
            kv_bytes_100k=cfg.kv_cache_bytes(LONG_CONTEXT),
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
