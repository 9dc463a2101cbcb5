"""``edgelin bench``: speed and memory of an export next to PyTorch eager, a softmax KV-cache twin and the O(T^2) form."""

from __future__ import annotations

import click

from edgelin.cli.common import fail, progress, user_errors

SECTION_NAMES = ("decode, throughput, position, prefill, sweep, floor; opt-in: fla, decay, precision, llamacpp, lowering, hybrid, transformers, "
                 "genai")


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.argument("source", required=False, type=click.Path(path_type=str))
@click.option("--provider", default="cpu", show_default=True, help="ONNX Runtime provider: cpu, auto (CUDA if really active) or cuda.")
@click.option("--threads", type=int, default=1, show_default=True, help="Threads for torch and ONNX Runtime (intra-op), set explicitly.")
@click.option("--quick", is_flag=True, help="Tiny lengths, few repeats, small sweep: a smoke run for CI (about a minute, mostly exports); numbers mean little.")
@click.option("--out", "out_dir", default="bench-results", show_default=True, type=click.Path(file_okay=False, path_type=str),
              help="Folder for bench.json and the PNG plots (created if needed).")
@click.option("--section", "sections", multiple=True, help=f"Run only this section (repeatable): {SECTION_NAMES} [default: all].")
@click.option("--memory-cap", "memory_cap", type=float, default=None,
              help="GB; prefill cases predicted to need more are skipped [default: half the available memory].")
@click.option("--no-plots", is_flag=True, help="Write only the JSON and the table.")
@click.option("--force", is_flag=True, help="Replace OUT/bench.json and OUT/*.png even where an earlier bench run did not write them.")
@click.option("--checkpoint", "genai_checkpoint", type=click.Path(file_okay=False, path_type=str),
              help="genai section: a transformers checkpoint folder both tools read, instead of building the published models.")
@click.option("--genai-model", "genai_models", multiple=True, help="genai section: lfm2-350m, qwen3.5-0.8b (repeatable) [default: both].")
@click.option("--genai-precision", "genai_precisions", multiple=True,
              help="genai section: fp32, int8, int4, int4-table4 (edgelin's int4 with --embedding int4) (repeatable) [default: all].")
@click.option("--genai-threads", "genai_threads", type=int, multiple=True, help="genai section: thread counts (repeatable) [default: 1, 2 and --threads].")
@click.option("--genai-rounds", type=int, default=None, help="genai section: rounds, each contender once per round in its own process [default: 5]; a shared machine's speed moves between processes, and the table says where the rounds do not resolve a ratio.")
@click.option("--genai-ops", "genai_ops", multiple=True, type=click.Choice(["portable", "fused"]),
              help="genai section: edgelin's lowerings (repeatable) [default: both].")
@click.option("--genai-venv", type=click.Path(file_okay=False, path_type=str),
              help="genai section: a venv with onnxruntime-genai [default: DIR/venv, made on first use].")
@click.option("--genai-dir", type=click.Path(file_okay=False, path_type=str),
              help="genai section: cache folder DIR for the venv, checkpoints and exports [default: $EDGELIN_GENAI_DIR or ~/.cache/edgelin/genai].")
@click.option("--genai-record", type=click.Path(file_okay=False, path_type=str),
              help="genai section: folder for genai-MODEL.json records [default: docs/bench of this checkout, else OUT].")
@click.option("--genai-profile/--no-genai-profile", default=None,
              help="genai section: after each precision's rounds at the most threads, one more run of each ONNX Runtime "
                   "contender with its profiler on: kernel time per decode step by operator type, side by side [default: on].")
@user_errors
def bench(source, provider, threads, quick, out_dir, sections, memory_cap, no_plots, force, genai_checkpoint, genai_models, genai_precisions,
          genai_threads, genai_rounds, genai_ops, genai_venv, genai_dir, genai_record, genai_profile):
    """Benchmark SOURCE: decode latency, throughput vs batch, decode vs position, prefill, the floor.

    SOURCE is a checkpoint folder (config.json + model.safetensors) or an export folder
    (edgelin.json); default: the bundled model, else a default-size LinearLM with random weights
    (d_model 256, 4 layers, 4 heads x 64, vocab 256; speed does not depend on weights).

    \b
    Sections (every figure: median [p10-p90] after warm-up; compared contenders interleaved):
      decode    ms per token, batch 1 and 8: ORT (run, IO binding) vs PyTorch eager step;
                graph nodes as exported and as ONNX Runtime runs them
      throughput
                ORT decode (IO binding) at batch 1, 2, 4 .. 64: ms per step, tokens/s
      position  decode at positions 128..64k vs two softmax twins: KV cache concatenated per
                step, and ORT's GroupQueryAttention on a KV buffer updated in place; the
                fastest baseline named per position; state vs KV bytes
      prefill   tokens/s and peak memory, T = 256..65,536: chunked graph, O(T^2) masked form,
                softmax twin, chunked in the runtime's 1,024-token pieces; too-big cases are skipped, with why
      sweep     prefill tokens/s vs the graph's chunk size (16..256), one export each
      floor     copy bandwidth, decode weight bytes: the lower bound per token, measured / bound
    Opt-in (run only when named with --section; fla and decay build their own models):
      fla       a tiny flash-linear-attention checkpoint: import + export wall time; decode ms per
                token of its ONNX graph vs the imported PyTorch step vs fla's own step (on CPU fla
                runs only in Triton's interpreter); skipped, with why, when fla is not installed
      decay     LinearLM (bundled-model size, random weights) with each decay, and the Gated
                DeltaNet-style scalar+delta, vs the plain one: decode ms per token, prefill
                tokens/s and peak memory at 1k, 4k and 16k in one call each (16k over 1k: the
                scaling) and 16k in the runtime's 1,024-token pieces, node counts
      precision SOURCE (a checkpoint; default the bundled model) exported as fp32, fp16, int8 and
                int4: size on disk, decode ms per token at batch 1 and 8, prefill tokens/s and peak
                memory at 1k and 4k, the weight-bytes floor per token; ratios against fp32
      llamacpp  an LFM2 and a Mamba2 transformers checkpoint (hidden 256, 4 layers) as GGUF
                F32/F16/Q8_0/Q4_0 and edgelin fp32/fp16/int8/int4, threads 1 and 2: decode
                (llama-bench tg128) and prefill (pp512, pp4096) tokens/s, alternating rounds;
                greedy ids of both vs transformers. Needs EDGELIN_LLAMA_CPP=DIR/llama.cpp from
                `bash scripts/llamacpp_build.sh DIR` (minutes); skipped, with why, without it
      hybrid    LinearLM stacks of the bundled model's size (random weights): every layer linear,
                the last layer softmax attention with a KV cache, every layer softmax; decode ms
                per token at batch 1 at context positions 1k, 16k and 64k (state built there),
                and the state's MB at each
      transformers  one checkpoint per Hugging Face family (Qwen3.5, Qwen3-Next dense, LFM2,
                Mamba2, Bamba, Granite-4.0-H; hidden 256, 4 layers, random weights) exported at
                fp32: decode ms/token (64 tokens) and prefill tokens/s (128, 1024) against
                transformers' own eager model with its cache, same threads, alternating rounds;
                greedy ids from a text prompt vs transformers' generate. Needs transformers
                (the test extra); skipped, with why, without it
      genai     edgelin vs onnxruntime-genai 0.18 on the same checkpoint: LFM2-350M and
                Qwen3.5-0.8B (published configurations, random weights; or --checkpoint DIR)
                exported by edgelin (--ops portable and fused) and by genai's builder (offline,
                in its own venv: made on first use, ~1 minute and 1.5 GB) at fp32, int8, int4;
                prefill (one 512-token call) and decode (median of 64 greedy steps after it) at 1
                and 2 threads, 3 rounds, each contender in its own process, the order
                alternating; weight bytes, decode nodes per layer, greedy ids vs genai's; then
                one run each under ONNX Runtime's profiler: kernel time per decode step by
                operator type, side by side (--no-genai-profile: not);
                llama.cpp's rows beside them where EDGELIN_LLAMA_CPP is set. Costs: ~2 GB of
                downloads once, several GB of exports kept in the cache folder, and about an hour
                for both models (--genai-model, --genai-precision, --genai-threads narrow it).
                Writes docs/bench/genai-MODEL.json (--genai-record) as each model completes

    Writes OUT/bench.json (atomically) and OUT/*.png (if matplotlib is installed: pip install
    'edgelin[plots]'); prints the table to stdout and progress to stderr. The table opens with
    the speed goals (edgelin/bench/goals.py: eager / ORT >= 4, <= 28 decode nodes per layer,
    <= 1.3x the weight-bytes floor, long prompts >= 0.9 of one piece's tokens/s) judged on this
    run's figures. Run it on a quiet machine; the full run takes a few minutes.

    \b
    Examples:
      edgelin bench --quick
      edgelin bench ckpt/ --threads 1 --out bench-results/
      edgelin bench out/ --section decode --section floor --threads 2
      edgelin bench --section fla
      edgelin bench --section decay
      edgelin bench --section hybrid --threads 1
      edgelin bench --section precision --provider cuda
      EDGELIN_LLAMA_CPP=/opt/llama/llama.cpp edgelin bench --section llamacpp
      edgelin bench --section genai --genai-model lfm2-350m --genai-precision fp32 --genai-precision int4
    """
    from edgelin.bench import run_bench

    names = [n.strip() for s in sections for n in s.split(",") if n.strip()]
    if sections and not names:  # `--section ''` would otherwise run every section
        fail(f"--section names no section; choose from {SECTION_NAMES}")
    given = {"--checkpoint": genai_checkpoint, "--genai-model": genai_models, "--genai-precision": genai_precisions,
             "--genai-threads": genai_threads, "--genai-rounds": genai_rounds, "--genai-ops": genai_ops, "--genai-venv": genai_venv,
             "--genai-dir": genai_dir, "--genai-record": genai_record, "--genai-profile/--no-genai-profile": genai_profile}
    if "genai" not in names and any(v not in (None, ()) for v in given.values()):
        fail(f"{', '.join(k for k, v in given.items() if v not in (None, ()))}: options of the genai section; add --section genai")
    genai = None
    if "genai" in names:
        from edgelin.bench.genai_cache import default_record_dir

        genai = {"checkpoint": genai_checkpoint, "models": genai_models or None, "precisions": genai_precisions or None,
                 "thread_counts": genai_threads or None, "rounds": genai_rounds, "ops": genai_ops or ("portable", "fused"),
                 "venv": genai_venv, "cache_dir": genai_dir, "record_dir": genai_record or default_record_dir(out_dir),
                 "profile": genai_profile is not False}
    report = run_bench(source, provider=provider, threads=threads, quick=quick, out_dir=out_dir, sections=names or None,
                       memory_cap_gb=memory_cap, plots=not no_plots, progress=progress, overwrite=force, genai=genai)
    click.echo(report.table())
    click.echo(f"wrote {report.json_path}" + (f" and {len(report.plots)} plot(s)" if report.plots else ""))
