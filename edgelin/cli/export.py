"""``edgelin export`` and ``edgelin models``: a checkpoint to two ONNX graphs, and the families that export."""

from __future__ import annotations

import click

from edgelin.cli.common import BUDGET_HELP, fail, progress, user_errors
from edgelin.parity import BUDGETS  # one precision per budget table (numpy only)


def default_checkpoint(checkpoint: str | None) -> str:
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


@click.command("export")
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
        default_checkpoint(checkpoint), out_dir, opset=opset, chunk_size=chunk_size,
        force=force, check=not no_check, progress=progress, precision=precision, state_dtype=state_dtype, ragged=ragged,
        tokenizer=tokenizer, budget=parity.overrides_of(budgets), embedding=embedding, int8_scheme=int8_scheme, ops=ops, max_sequence=max_sequence,
        trace_cache=trace_cache, logits_at=not all_logits,
    )
    click.echo(result.summary())


def _families_help() -> str:
    from edgelin.importers.catalog import families_text

    return "\n".join(f"      {line}" for line in families_text().splitlines())  # the docstring's indent + 2


export_cmd.help = export_cmd.help.replace("    FAMILIES", _families_help())


@click.command("models")
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
