"""The ``edgelin`` command line: a thin layer over the library, one library function per command.

Errors a user can fix (``EdgelinError``) print one line, ``edgelin: error: ...``, and exit with status 2.
torch is imported lazily, inside the commands that need it.
"""

from __future__ import annotations

import sys

import click

from edgelin import __version__
from edgelin.cli_common import OneLineGroup, fail, progress, user_errors
from edgelin.errors import EdgelinError
from edgelin.parity import BUDGETS  # one precision per budget table (numpy only)
from edgelin.demo import DEFAULT_PROMPTS, DEFAULT_SAMPLING  # constants only (the demo module loads torch lazily)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="edgelin")
def main() -> None:
    """Deploy linear-attention language models with ONNX.

    \b
    A typical session:
      edgelin export CHECKPOINT -o out/      # two ONNX graphs (prefill + decode) + edgelin.json
      edgelin generate out/ --prompt "Hi"    # stream tokens from ONNX Runtime

    Every command has --help.
    """


def _default_checkpoint(checkpoint: str | None) -> str:
    if checkpoint is not None and not checkpoint.strip():
        fail(f"CHECKPOINT is {checkpoint!r}, an empty name; pass a checkpoint folder (config.json + model.safetensors), "
             "or leave it out for the bundled model")
    if checkpoint is not None:
        return checkpoint
    from edgelin.models import bundled_checkpoint

    path = bundled_checkpoint()
    if path is None:
        fail("no CHECKPOINT given and this install has no bundled model; pass a checkpoint folder (config.json + model.safetensors)")
    return str(path)


BUDGET_HELP = ("A parity bound of your own, KIND.BOUND=VALUE (repeatable), e.g. logits.max_rel=3e-5: kinds logits, state, "
               "provider, long, top1, greedy, heldout; bounds max_abs, max_rel (max abs / max(1, max |reference|)), rel_l2, "
               "min_agreement, max_bpb_delta. See docs/parity.md.")


@main.command("export")
@click.argument("checkpoint", required=False, type=click.Path(file_okay=True, dir_okay=True))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write (must not exist unless --force).")
@click.option("--opset", default=18, show_default=True, type=int, help="ONNX opset, 18..23. 18 runs on the most runtimes.")
@click.option("--chunk-size", type=int, default=None, help="Chunk length of the prefill graph's parallel form [default: the model's].")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is empty or an edgelin export (only once the new export succeeded); any other folder is refused.")
@click.option("--no-check", is_flag=True, help="Skip the ONNX Runtime vs PyTorch smoke comparison.")
@click.option("--precision", type=click.Choice(list(BUDGETS)), default="fp32", show_default=True,
              help="Weights/activations: fp16 (state sums in fp32), int8 (per-channel or block weights: --int8-scheme), "
                   "int4 (MatMulNBits, blocks of 32).")
@click.option("--state-dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="How the recurrent state is stored between steps; float16 only with --precision fp16.")
@click.option("--ragged", is_flag=True,
              help="The prefill graph also takes per-row lengths (int64 [batch]): prompts of different lengths prefill in one call, right-padded.")
@click.option("--all-logits", is_flag=True,
              help="The prefill graph returns every position's logits, with no logits_at input (as exports made before it): "
                   "only for a client older than that input. By default the runtimes ask for each piece's last position, "
                   "and the head runs on that row only (prefill ~1.2x faster at a 65k vocabulary).")
@click.option("--tokenizer", "tokenizer", type=click.Path(), default=None,
              help="A Hugging Face tokenizer (a folder with tokenizer.json, or the file) to export with the model "
                   "[default: CHECKPOINT's own tokenizer.json, if it has one].")
@click.option("--budget", "budgets", multiple=True, metavar="KIND.BOUND=VALUE",
              help=BUDGET_HELP + " The smoke check is held to it, and it is recorded in edgelin.json for validate.")
@click.option("--embedding", type=click.Choice(["int8", "int4", "fp32"]), default=None,
              help="int8/int4 exports: how the token embedding and a tied head are stored, block-quantised (block 32) or "
                   "exact [default: int8; a 250k x 1024 table is 1 GB in fp32, 0.29 GB in int8, 0.16 GB in int4].")
@click.option("--int8-scheme", type=click.Choice(["channel", "block"]), default=None,
              help="int8 exports: per-channel weights with one activation scale per tensor (channel: the faster prefill, and "
                   "the fast one in a browser's WASM backend) or 8-bit blocks of 32 with activations quantised per block "
                   "(block: llama.cpp's Q8_0, closer to fp32; natively the faster decode and the slower prefill, in WASM "
                   "several times slower: LFM2-350M decodes 4 tokens/s there, 27 per channel with --embedding fp32) "
                   "[default: block for a transformers "
                   "checkpoint, whose trained activations one scale per tensor cannot resolve; channel otherwise]. docs/guide.md's "
                   "'Edge precision' and 'In the browser' say more.")
@click.option("--ops", type=click.Choice(["portable", "fused"]), default="portable", show_default=True,
              help="How linear attention's recurrence is written: portable (ONNX standard operators; every runtime) or "
                   "fused (one ONNX Runtime com.microsoft.LinearAttention node per layer, and one CausalConvWithState node "
                   "per short conv; ONNX Runtime >= 1.30: Python, onnxruntime-node, onnxruntime-web). The state is the "
                   "same either way. docs/performance.md says which is faster where.")
@click.option("--max-sequence", type=int, default=4096, show_default=True, metavar="TOKENS",
              help="The most tokens one prefill call takes, for graphs whose size depends on it (the portable delta rule's "
                   "scan across chunks: each doubling adds a level, ~1 s of export per layer). Recorded in edgelin.json; "
                   "the runtimes cut longer prompts into pieces of at most this many tokens. Other models take any length.")
@click.option("--trace-cache", type=click.Path(), default=None, metavar="DIR",
              help="Keep each traced graph in DIR and take it from there when the same model (weights, code, --ragged, --all-logits, "
                   "--opset, --ops, --max-sequence) is exported again, in any precision: the trace is most of an export's "
                   "time. Entries are about the fp32 model's size per graph; delete DIR when done.")
@user_errors
def export_cmd(checkpoint, out_dir, opset, chunk_size, force, no_check, precision, state_dtype, ragged, all_logits, tokenizer, budgets, embedding,
               int8_scheme, ops, max_sequence, trace_cache):
    """Export CHECKPOINT to two ONNX graphs (prefill + decode) and edgelin.json.

    CHECKPOINT is a folder with config.json and model.safetensors (default: the bundled model):
    a Hugging Face transformers or flash-linear-attention save_pretrained folder of a family below,
    or an edgelin checkpoint. `edgelin models` shows the families with their layer kinds.

    \b
    FAMILIES

    A tokenizer.json in it (or --tokenizer) is copied into OUT and described in edgelin.json, with the
    bos/eos/pad ids of generation_config.json, config.json or tokenizer_config.json.
    The export is written to a temporary folder and moved to OUT only when both graphs exported,
    passed onnx.checker (full check) and the smoke comparison; a failure leaves nothing behind.

    \b
    Examples:
      edgelin export models/stdlib-linear -o out/
      edgelin export ckpt/ -o out/ --chunk-size 128 --force
      edgelin export -o out-int8/ --precision int8
      edgelin export -o out-q8/ --precision int8 --int8-scheme block
      edgelin export -o out-int4/ --precision int4 --embedding int4
      edgelin export -o out-ragged/ --ragged
      edgelin export fla-ckpt/ -o out/ --tokenizer path/to/tokenizer/
      edgelin export my-ckpt/ -o out/ --budget logits.max_rel=3e-5
      edgelin export -o out-fused/ --ops fused
      edgelin export ckpt/ -o out-int8/ --precision int8 --trace-cache traces/   # then int4: no second trace
    """
    from edgelin import parity
    from edgelin.exporters import export

    result = export(
        _default_checkpoint(checkpoint), out_dir, opset=opset, chunk_size=chunk_size,
        force=force, check=not no_check, progress=progress, precision=precision, state_dtype=state_dtype, ragged=ragged,
        tokenizer=tokenizer, budget=parity.overrides_of(budgets), embedding=embedding, int8_scheme=int8_scheme, ops=ops, max_sequence=max_sequence,
        trace_cache=trace_cache, logits_at=not all_logits,
    )
    click.echo(result.summary())


def _families_help() -> str:
    from edgelin.importers.catalog import families_text

    return "\n".join(f"      {line}" for line in families_text().splitlines())  # the docstring's indent + 2


export_cmd.help = export_cmd.help.replace("    FAMILIES", _families_help())


@main.command("models")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown (the README's supported-models table).")
@click.option("--refused", is_flag=True, help="List the families edgelin knows of and does not export yet, with what blocks each.")
@user_errors
def models_cmd(markdown, refused):
    """The model families edgelin exports: framework, model_type, layer kinds.

    Every family exports at fp32, fp16, int8 and int4, runs in the Python, node and browser runtimes,
    and is held to its framework's own model by the tests and by `edgelin validate --upstream`.

    \b
    Examples:
      edgelin models
      edgelin models --refused      # what is not exported yet, and why
      edgelin models --markdown
    """
    from edgelin.importers import catalog

    if markdown:
        click.echo(catalog.table_markdown(refused=refused))
    else:
        click.echo(catalog.table_text(refused=refused))


@main.command("validate")
@click.argument("export_dir", type=click.Path(file_okay=False))
@click.option("--checkpoint", type=click.Path(), default=None, help="The checkpoint the export came from [default: the bundled model, if the export is of it].")
@click.option("--providers", default="cpu", show_default=True, help="Comma list of cpu, cuda, openvino, dml, coreml, webgpu; or 'auto' (CUDA only if really active, never a failure).")
@click.option("--steps", default=64, show_default=True, type=int, help="Decode steps compared one by one, state fed back.")
@click.option("--long", "long_steps", default=0, show_default=True, type=int, help="Also decode this many steps against a float64 PyTorch run (drift curve); e.g. 10000.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full report (every number, the drift curve) here.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random token ids.")
@click.option("--force", is_flag=True, help="Let --json replace a file that is not an earlier validate report, or one that is part of an export.")
@click.option("--budget", "budgets", multiple=True, metavar="KIND.BOUND=VALUE",
              help=BUDGET_HELP + " Applies over the export's own (edgelin export --budget); the report lists every bound set.")
@click.option("--upstream", type=click.Choice(["off", "auto", "required"]), default="auto", show_default=True,
              help="For a transformers or fla checkpoint, also run that framework's own model (in a subprocess, on CPU) "
                   "and compare it with edgelin's import and with the graphs. auto: where the framework is installed; "
                   "required: refuse to run without it; off: skip.")
@click.option("--kv", "kv_lengths", default="1024,16384", show_default=True, metavar="LENGTHS",
              help="For a model with a KV cache (a hybrid): prompt lengths after which the cache and every state are "
                   "compared with a float64 PyTorch run (comma list; 0 = none). Lengths past the model's context are n/a.")
@click.option("--prepack/--no-prepack", default=True, show_default=True,
              help="Let ONNX Runtime pack the CPU session's weights, as the runtime does by default; --no-prepack reads "
                   "them in place from weights.data (one copy of the weights fewer: for a large model beside the float64 "
                   "reference; the same kernels on unpacked weights).")
@user_errors
def validate_cmd(export_dir, checkpoint, providers, steps, long_steps, json_path, seed, force, budgets, upstream, kv_lengths, prepack):
    """Check that EXPORT_DIR computes what its PyTorch checkpoint computes.

    \b
    Checks: structure (manifest <-> graphs, metadata, weights hash), prefill vs PyTorch, decode vs
    PyTorch step by step, prefill vs decode, each provider vs CPU, a long decode stream vs float64
    PyTorch, a hybrid's KV cache after 1k and 16k tokens vs float64 PyTorch, greedy generation, and
    held-out text (bits/byte, read through the export's tokenizer). Every failure is reported with
    where it diverged first.

    \b
    An int8 or int4 export's states are held to PyTorch computing the export's own quantisation
    (dequantised weights, activations rounded as ONNX Runtime rounds them); its logits, greedy and
    held-out text to fp32 PyTorch.

    \b
    For a Hugging Face transformers or fla checkpoint, "PyTorch" above is edgelin's import of it. The
    upstream group then runs the framework's own model on the same ids and compares it with the import
    and with the graphs (prefill logits, cached decode, greedy ids); an import that departs names the
    first layer where it does.

    \b
    Exit status: 0 all checks passed, 1 a check failed (or a provider named in --providers is not
    really active), 2 bad input.

    \b
    Examples:
      edgelin validate out/ --checkpoint ckpt/
      edgelin validate out/ --checkpoint ckpt/ --providers cpu,cuda --long 10000 --json report.json
      edgelin validate out/ --checkpoint ckpt/ --budget logits.max_rel=3e-5 --budget top1.min_agreement=0.9
      edgelin validate out/ --checkpoint Qwen3.5-0.8B/ --upstream required --steps 16
    """
    from edgelin import parity
    from edgelin.runtime.files import check_output_file
    from edgelin.validate import REPORT_FILE, validate

    overrides = parity.overrides_of(budgets)  # a bad --budget is refused before anything runs
    try:
        kv = [int(x) for x in kv_lengths.replace(" ", "").split(",") if x]
    except ValueError:
        raise EdgelinError(f"--kv takes prompt lengths separated by commas (e.g. 1024,16384; 0 = none), got {kv_lengths!r}") from None
    kv = [] if kv == [0] else kv
    if json_path is not None:  # before the checks run: a bad path must not cost the report
        check_output_file(json_path, "report file", overwrite=force, ours=REPORT_FILE)
    report = validate(export_dir, checkpoint, providers=providers, steps=steps, long=long_steps, seed=seed, progress=progress,
                      budget=overrides, upstream=upstream, kv=kv, prepack=prepack)
    click.echo(report.table())
    if json_path:
        report.write_json(json_path, overwrite=force)
    sys.exit(0 if report.passed else 1)


@main.command("check")
@click.argument("export_dir", type=click.Path(file_okay=False))
@click.option("--providers", default="cpu", show_default=True, metavar="LIST",
              help="Comma list of execution providers: cpu, cuda, openvino, dml, coreml, webgpu. Each is compared with the golden "
                   "outputs, and each after the first with the first.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full report here.")
@click.option("--force", is_flag=True, help="Let --json replace a file that is not an earlier check report, or one that is part of an export.")
@user_errors
def check_cmd(export_dir, providers, threads, json_path, force):
    """Check EXPORT_DIR on this device's execution providers, without PyTorch.

    \b
    Runs the inputs stored at export time (golden.json: two prompts prefilled in two pieces, then 8 decode
    steps with the state fed back) on each provider and compares the logits with the PyTorch model's,
    stored beside them, within the budgets of the export's precision; each provider after the first is
    also compared with the first, in full. An export without golden outputs (made by an earlier edgelin)
    gets only the comparison across providers. Needs only numpy and onnxruntime (the build that has the
    provider: onnxruntime-gpu for cuda, onnxruntime-openvino for openvino).

    \b
    Exit status: 0 every comparison within budget, 1 one is not (or a provider is not available), 2 bad input.

    \b
    Examples:
      edgelin check out/
      edgelin check out/ --providers cpu,openvino --json check.json
    """
    from edgelin.runtime.files import check_output_file, json_format, write_json
    from edgelin.runtime.golden import check
    from edgelin.runtime.options import check_int
    from edgelin.runtime.providers import EXECUTION_PROVIDERS

    names = [n.strip().lower() for n in providers.split(",") if n.strip()]
    bad = [n for n in names if n not in EXECUTION_PROVIDERS]
    if bad or not names:
        fail(f"--providers must be a comma list of {', '.join(EXECUTION_PROVIDERS)}, got {providers!r}")
    if len(set(names)) != len(names):
        fail(f"--providers names a provider twice: {providers!r}")
    if threads is not None:
        check_int("--threads", threads, low=1, high=1024)
    ours = json_format("edgelin-check/", "an edgelin check report (JSON with format edgelin-check/1)")
    if json_path is not None:
        check_output_file(json_path, "report file", overwrite=force, ours=ours)
    report = check(export_dir, names, threads=threads, progress=progress)
    click.echo(report.table())
    if json_path:
        write_json(json_path, report.to_dict(), overwrite=force, ours=ours, what="report file")
    sys.exit(0 if report.passed else 1)


@main.command("demo")
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


# `generate` lives in its own module: it needs only the torch-free runtime
from edgelin.cli_generate import generate  # noqa: E402

main.add_command(generate)

from edgelin.cli_bench import bench  # noqa: E402

main.add_command(bench)

from edgelin.cli_web import web  # noqa: E402

main.add_command(web)


if __name__ == "__main__":  # pragma: no cover
    main()
