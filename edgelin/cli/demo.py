"""``edgelin demo``: the bundled model exported, validated and streaming text."""

from __future__ import annotations

import sys

import click

from edgelin.cli.common import progress, user_errors
from edgelin.demo import DEFAULT_PROMPTS, DEFAULT_SAMPLING  # constants only (the demo module loads torch lazily)


@click.command("demo")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT",
              help="Text for the model to continue; repeat for several [default: 'def fibonacci(n):' and 'The for statement is used to'].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None, help="Keep the export in this folder; an existing one is replaced only if it is empty or an edgelin export [default: a temporary folder].")
@click.option("--max-new-tokens", "-n", default=200, show_default=True, type=int, help="Tokens to generate per prompt.")
@click.option("--temperature", "-t", default=DEFAULT_SAMPLING["temperature"], show_default=True, type=float, help="0 = greedy (a small model then tends to loop).")
@click.option("--top-p", default=DEFAULT_SAMPLING["top_p"], show_default=True, type=float, help="Nucleus sampling: keep the most likely tokens up to this probability (1 = off).")
@click.option("--seed", default=DEFAULT_SAMPLING["seed"], show_default=True, type=int, help="Sampling seed (the same seed gives the same text).")
@click.option("--repetition-penalty", default=DEFAULT_SAMPLING["repetition_penalty"], show_default=True, type=float,
              help="Hugging Face's repetition penalty (1 = off; on this byte-level model it pushes prose toward rare bytes).")
@click.option("--no-repeat-ngram-size", default=DEFAULT_SAMPLING["no_repeat_ngram_size"], show_default=True, type=int, metavar="N",
              help="Hugging Face's n-gram ban: no N bytes occur twice in a row, which ends the model's runs of spaces "
                   "after a block opener at N (0 = off: they reach 199).")
@click.option("--provider", default="auto", show_default=True, help="auto, cpu or cuda.")
@user_errors
def demo_cmd(prompts, out_dir, max_new_tokens, temperature, top_p, seed, repetition_penalty, no_repeat_ngram_size, provider):
    """Export the bundled model, validate it, and stream text from ONNX Runtime.

    The bundled model is a small byte-level linear-attention LM trained on the Python
    standard library's source and its pydoc topics. It continues a piece of code and a
    piece of prose (seeded sampling), then compares its fixed-size state with the KV cache
    a softmax transformer of the same size would need.

    \b
    Examples:
      edgelin demo
      edgelin demo --prompt "import os" --prompt "This module provides" --out demo-export/
      edgelin demo --temperature 0 -n 60        # greedy
    """
    import warnings

    from edgelin.demo import run_demo

    prompts = list(prompts) or list(DEFAULT_PROMPTS)
    started: set[int] = set()

    def stream(i: int, text: str) -> None:
        if i not in started:  # each continuation reads best after its prompt
            if started:
                click.echo("\n")
            started.add(i)
            click.echo(click.style(prompts[i], bold=True), nl=False)
        click.echo(text, nl=False)
        sys.stdout.flush()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = run_demo(prompts, out_dir, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=seed, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                           provider=provider, on_text=stream, progress=progress)
    click.echo("\n")
    for w in caught:
        if "CUDA" in str(w.message):
            progress(f"edgelin: note: {w.message}")
    for line in summary.lines():
        click.echo(line)
    sys.exit(0 if summary.parity == "PASS" else 1)
