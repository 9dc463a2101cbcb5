"""``edgelin validate`` (the export against its PyTorch checkpoint and framework) and ``edgelin check`` (on a device,
against the golden outputs, without PyTorch)."""

from __future__ import annotations

import sys

import click

from edgelin.cli.common import BUDGET_HELP, fail, progress, user_errors
from edgelin.errors import EdgelinError


@click.command("validate")
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


@click.command("check")
@click.argument("export_dir", type=click.Path(file_okay=False))
@click.option("--providers", default="cpu", show_default=True, metavar="LIST",
              help="Comma list of execution providers: cpu, cuda, openvino, dml, coreml, webgpu. Each is compared with the golden "
                   "outputs, and each after the first with the first.")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads [default: one per core].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full report here.")
@click.option("--force", is_flag=True, help="Let --json replace a file that is not an earlier check report, or one that is part of an export.")
@click.option("--prepack/--no-prepack", default=True, show_default=True,
              help="Let ONNX Runtime pack the CPU sessions' weights, as the runtime does by default (a copy of them per "
                   "graph); --no-prepack reads them in place from weights.data: an export whose packed weights do not fit "
                   "in memory checks that way, slower.")
@user_errors
def check_cmd(export_dir, providers, threads, json_path, force, prepack):
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
      edgelin check big-int8/ --threads 2 --no-prepack
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
    report = check(export_dir, names, threads=threads, progress=progress, prepack=prepack)
    click.echo(report.table())
    if json_path:
        write_json(json_path, report.to_dict(), overwrite=force, ours=ours, what="report file")
    sys.exit(0 if report.passed else 1)
