"""The main job, end to end: export the bundled model, validate it, stream text from ONNX Runtime, summarise."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgelin.config import ModelConfig
from edgelin.errors import EdgelinError
from edgelin.runtime.files import check_output_dir

DEFAULT_PROMPT = "The for statement"
LONG_CONTEXT = 100_000


@dataclass
class DemoSummary:
    export_dir: str
    parity: str  # "PASS" / "FAIL"
    checks: str  # "13 passed, 0 failed"
    provider: str
    prompt_tokens: int
    new_tokens: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    state_bytes: int  # per sequence, constant
    kv_bytes_now: int  # a same-size softmax model's fp32 KV cache at this length
    kv_bytes_100k: int

    def lines(self) -> list[str]:
        n = self.prompt_tokens + self.new_tokens
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
    prompt: str = DEFAULT_PROMPT,
    out_dir: str | Path | None = None,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.0,
    seed: int = 0,
    provider: str = "auto",
    on_text: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DemoSummary:
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint
    from edgelin.runtime import Manifest, generate_text
    from edgelin.validate import validate

    say = progress or (lambda _m: None)
    checkpoint = bundled_checkpoint()
    if checkpoint is None:
        raise EdgelinError("this install has no bundled model (edgelin/models/pydoc-linear); reinstall edgelin")
    if not prompt:
        raise EdgelinError("the prompt is empty; pass --prompt with some text")
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
        say(f"[3/3] generating from ONNX Runtime: {prompt!r}")
        result = generate_text(out, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, provider=provider, on_text=on_text)
        manifest = Manifest.load(out)
        cfg = ModelConfig.from_dict(manifest.model)
        total = result["prompt_tokens"] + result["new_tokens"]
        return DemoSummary(
            export_dir=str(out) if tmp is None else "(temporary; pass --out DIR to keep it)",
            parity="PASS" if report.passed else "FAIL",
            checks=f"{counts['pass']} passed, {counts['fail']} failed",
            provider=result["provider"],
            prompt_tokens=result["prompt_tokens"],
            new_tokens=result["new_tokens"],
            time_to_first_token_s=result["time_to_first_token_s"],
            decode_tokens_per_s=result["decode_tokens_per_s"],
            state_bytes=manifest.state_bytes(1),
            kv_bytes_now=cfg.kv_cache_bytes(total),
            kv_bytes_100k=cfg.kv_cache_bytes(LONG_CONTEXT),
        )
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
