"""``edgelin generate``: stream a continuation from an export with ONNX Runtime (torch-free)."""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections import Counter

import click

from edgelin.cli.common import user_errors
from edgelin.errors import RuntimeInputError


def _parse_ids(text: str, i: int, n: int) -> list[int]:
    """--prompt-ids "1,2,3" (commas and/or spaces) -> [1, 2, 3]; a one-line error naming the bad item."""
    where = f"--prompt-ids {i + 1} of {n}" if n > 1 else "--prompt-ids"
    items = [x for x in text.replace(",", " ").split()]
    if not items:
        raise RuntimeInputError(f"{where} is empty; give token ids such as 1,2,3")
    out = []
    for x in items:
        try:
            out.append(int(x))
        except ValueError:
            raise RuntimeInputError(f"{where}: {x[:40]!r} is not a token id; give integers such as 1,2,3") from None
    return out


def _check_text(option: str, text: str | None) -> None:
    """A chat message from the command line must be text: bytes that are not UTF-8 reach Python as lone surrogates."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RuntimeInputError(f"{option} holds bytes that are not UTF-8 (at character {exc.start}); a chat message must be "
                                "text: pass it in UTF-8") from None


def _summary(r: dict) -> str:
    def rate(x: float) -> str:
        return "n/a" if x is None or math.isnan(x) else f"{x:,.0f} tok/s"

    if "results" in r:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(Counter(x["stop_reason"] for x in r["results"]).items()))
        what = f"{len(r['results'])} prompts, {r['new_tokens']} new tokens ({reasons}), prompts {r['prompt_tokens']} tokens"
    else:
        what = f"{r['new_tokens']} new tokens ({r['stop_reason']}), prompt {r['prompt_tokens']} tokens"
    state = ""
    if r.get("state_grows"):  # a hybrid: its KV cache grows with the context, say how much it holds now
        state = f"; state {r['state_bytes'] / 1e6:.2f} MB (KV cache of {r['state_positions']:,} positions, grows with the context)"
    return (
        f"[{r['provider']}] {what}; "
        f"time to first token {r['time_to_first_token_s'] * 1e3:.1f} ms, prefill {rate(r['prefill_tokens_per_s'])}, "
        f"decode {rate(r['decode_tokens_per_s'])}{state}"
    )


@click.command("generate", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("export_dir", type=click.Path(path_type=str))
@click.option("--prompt", "-p", multiple=True,
              help="Text to continue (the model's tokenizer encodes it). Repeat for a batch: the prompts run together "
                   "and each continuation prints after the run, under a header naming its prompt.")
@click.option("--prompt-ids", "prompt_ids", multiple=True, metavar="IDS",
              help="Token ids to continue instead of text, e.g. 1,2,3 (commas or spaces). Repeatable for a batch. "
                   "Without a tokenizer in the export, the generated ids are printed.")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True, help="Tokens to generate at most.")
@click.option("--min-new-tokens", type=int, default=0, show_default=True, help="Generate at least this many tokens: no eos before (as Hugging Face's min_new_tokens).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Hugging Face's (CTRL) penalty on every id already in the sequence: 1 = off, 1.1-1.3 discourages loops.")
@click.option("--no-repeat-ngram-size", type=int, default=0, show_default=True, metavar="N",
              help="Hugging Face's n-gram ban: no N tokens in a row occur twice in the sequence (0 = off). "
                   "Stops loops outright; the demo uses 16 for its byte-level model (a run of spaces ends at 16).")
@click.option("--temperature", "-t", type=float, default=0.0, show_default=True, help="0 = greedy; higher = more random.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample only from the K most likely tokens (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling: smallest set of tokens with probability >= P (1 = off).")
@click.option("--seed", type=int, default=None, help="Seed for sampling: the same seed gives the same text.")
@click.option("--stop", multiple=True, help="Stop when this text appears (not printed). Repeatable.")
@click.option("--provider", default="auto", show_default=True, help="auto (CUDA if really active, else CPU), cpu, cuda, or openvino, dml, coreml, webgpu (with the onnxruntime build or plugin that has it).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime threads (default: one per core).")
@click.option("--state-in", type=click.Path(path_type=str), default=None, help="Continue from a state saved with --state-out.")
@click.option("--state-out", type=click.Path(path_type=str), default=None, help="Save the state after the generated text (.npz, written atomically).")
@click.option("--force", is_flag=True,
              help="Let --state-out replace a file that is not an edgelin state file, or one that is part of an export "
                   "(an earlier state file is replaced without it).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text + timings) instead of streaming.")
@click.option("--chat", is_flag=True,
              help="Treat --prompt as a user's message: render it with the tokenizer's chat template (tokenizer_config.json), "
                   "the assistant's turn opened, as transformers' apply_chat_template does. Several turns: edgelin.runtime.Chat.")
@click.option("--system", default=None, help="With --chat: a system message before the user's.")
@user_errors
def generate(export_dir, prompt, prompt_ids, max_new_tokens, min_new_tokens, repetition_penalty, no_repeat_ngram_size, temperature,
             top_k, top_p, seed, stop,
             provider, threads, state_in, state_out, force, as_json, chat, system):
    """Generate text from an export folder (prefill.onnx + decode.onnx + edgelin.json).

    Text streams to stdout as it is produced; a summary line with the provider actually used and the
    timings goes to stderr. Several --prompt run as one batch (prompts of similar length prefilled
    together, decode batched; each continuation is that of its prompt alone), printed when all are done.
    Runs on ONNX Runtime alone: torch is not imported.

    \b
    Examples:
      edgelin generate out/ --prompt "Once upon a time"
      edgelin generate out/ -p "The " -n 200 --temperature 0.8 --top-p 0.9 --seed 1
      edgelin generate out/ -p "Q: hi" --stop "Q:" --json
      edgelin generate out/ -p "Hello, " --state-out chat.npz     # keep the conversation ...
      edgelin generate out/ -p " and then" --state-in chat.npz    # ... and continue it later
      edgelin generate out/ -p "def add(" -p "import " -n 40         # a batch of two prompts
      edgelin generate out/ -p "class Stack:" --repetition-penalty 1.2
      edgelin generate out/ -p "class Stack:" -t 0.7 --top-p 0.9 --no-repeat-ngram-size 16 --seed 0
      edgelin generate out/ --prompt-ids 1,2,3 -n 20                 # token ids in (and out, without a tokenizer)
      edgelin generate out/ --chat -p "What is a stack?" --system "Be brief."   # the chat template's turn
    """
    from edgelin.runtime import ProviderWarning, generate_text

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    with warnings.catch_warnings():  # a warning (e.g. CUDA not active) is one line on stderr, printed when it happens
        warnings.simplefilter("always", ProviderWarning)
        warnings.showwarning = lambda message, *_, **__: click.echo(f"edgelin: warning: {message}", err=True)
        if prompt and prompt_ids:
            raise RuntimeInputError("give --prompt or --prompt-ids, not both")
        if not prompt and not prompt_ids:
            raise RuntimeInputError("no prompt given; give some text with --prompt, or token ids with --prompt-ids 1,2,3")
        if system is not None and not chat:
            raise RuntimeInputError("--system goes with --chat (a system message of a chat)")
        if chat:
            if prompt_ids or len(prompt) != 1:
                raise RuntimeInputError("--chat takes one --prompt: the user's message (several turns: edgelin.runtime.Chat in Python)")
            from edgelin.runtime.chat import chat_ids

            for option, text in (("--prompt", prompt[0]), ("--system", system)):
                _check_text(option, text)
            messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": prompt[0]}]
            prompt_ids, prompt = (chat_ids(export_dir, messages),), ()
        ids = [ids_ if isinstance(ids_, list) else _parse_ids(ids_, i, len(prompt_ids)) for i, ids_ in enumerate(prompt_ids)]
        batch = len(prompt or ids) > 1
        texts = (list(prompt) if batch else prompt[0]) if prompt else None
        result = generate_text(
            export_dir, texts, prompt_ids=(ids if batch else ids[0]) if ids else None, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
            temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed, stop=stop, provider=provider, threads=threads, state_in=state_in,
            state_out=state_out, overwrite=force, on_text=None if as_json or batch else stream,
        )
    if as_json:
        clean = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}
        click.echo(json.dumps(clean))
        return
    def shown(r: dict) -> str:  # the text, or the ids where no tokenizer decoded them
        return r["text"] if result["has_text"] else " ".join(map(str, r["ids"]))

    if batch:
        for i, r in enumerate(result["results"]):
            click.echo(f"--- prompt {i + 1} of {len(result['results'])}: {r['prompt']!r} ({r['stop_reason']}) ---")
            click.echo(shown(r))
    else:
        click.echo("" if result["has_text"] else shown(result))
    click.echo(_summary(result), err=True)
