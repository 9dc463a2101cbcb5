"""What one bench run measures: the sections, the sizes and repeat counts (``FULL``, ``QUICK``), the caps,
the checked options, and the model under test (``Subject``)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from onnx import TensorProto, helper
from torch import nn

from edgelin import protocol
from edgelin.checkpoint import load_checkpoint
from edgelin.config import ModelConfig
from edgelin.errors import ConfigError, EdgelinError
from edgelin.exporters.exporter import DEFAULT_OPSET
from edgelin.runtime.manifest import PREFILL_PIECE
from edgelin.model import LinearLM
from edgelin.models import bundled_checkpoint
from edgelin.runtime.options import check_int, check_number
from edgelin.runtime.manifest import MANIFEST_FILE, Manifest
from edgelin.runtime.providers import open_session

from .harness import meminfo

SECTIONS = ("decode", "throughput", "position", "prefill", "sweep", "floor")  # the default run: the model under test
# Sections run only when asked for (``--section NAME``); fla and decay build their own models, precision
# exports the model under test (a checkpoint folder or model; default the bundled model) once per precision.
#   fla    a flash-linear-attention checkpoint imported + exported, decode vs fla's own step (``foreign``)
#   decay  LinearLM with each decay vs the plain one, same size: decode, prefill, graph nodes (``decay``)
#   precision  the source in fp32 / fp16 / int8 / int4: size, decode, prefill, weight-bytes floor (``precision``)
#   llamacpp  an LFM2 and a Mamba2 transformers checkpoint: edgelin vs llama.cpp (EDGELIN_LLAMA_CPP), tokens/s, greedy ids (``llamacpp``)
#   lowering  portable vs fused graphs (export --ops) of three models in the Python runtime, node and WASM (``lowering``)
#   hybrid  linear, hybrid (last layer softmax attention) and softmax stacks of one size: decode ms and state bytes
#           against context position (``hybrid``)
#   transformers  each Hugging Face family's export vs transformers' own eager model: decode, prefill, greedy ids
#           from a text prompt (``transformers_eager``)
#   genai  edgelin vs onnxruntime-genai (its builder, in its own venv) on the same checkpoint: decode, prefill, weight bytes,
#           decode nodes per layer, llama.cpp beside them where built (``genai``)
OPT_IN_SECTIONS = ("fla", "decay", "precision", "llamacpp", "lowering", "hybrid", "transformers", "genai")
ALL_SECTIONS = SECTIONS + OPT_IN_SECTIONS
PROVIDERS = ("cpu", "auto", "cuda")
MAX_THREADS = 1024

# The documented default model when no checkpoint is given and none is bundled (speed does not depend on weights).
DEFAULT_MODEL = {"vocab_size": 256, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64}
MODEL_SEED, SOFTMAX_SEED, DATA_SEED = 0, 1, 2

Progress = Callable[[str], None]


class BenchError(EdgelinError):
    """A benchmark could not be set up (bad option, unusable model path, a baseline that failed its check)."""


@dataclass(frozen=True)
class Plan:
    """Sizes and repeat counts of one benchmark run (``FULL`` or ``QUICK``)."""

    decode_batches: tuple[int, ...]
    decode_warmup: int  # calls per contender before timing
    decode_rounds: int  # interleaved rounds ...
    decode_per_round: int  # ... of this many timed calls per contender
    throughput_batches: tuple[int, ...]  # decode throughput curve (timed with the decode_* counts); 1 first: the reference
    positions: tuple[int, ...]
    position_warmup: int
    position_rounds: int
    position_per_round: int
    prefill_lengths: tuple[int, ...]
    piece: int  # piece length of the state-carried chunked prefill (FULL: the runtime's default, the manifest's prefill_piece)
    piece_from: int  # ... measured for T >= this
    case_budget_s: float  # timed seconds per prefill case (after its first run)
    min_repeats: int
    max_repeats: int
    case_time_cap_s: float  # skip a prefill case predicted to take longer than this per run
    sweep_length: int
    sweep_chunks: tuple[int, ...]  # the model's own chunk size is always added
    bandwidth_bytes: int
    bandwidth_repeats: int
    floor_calls: int
    fla_export_repeats: int  # import + export of the fla checkpoint, each into a fresh folder
    fla_warmup: int  # fla section's decode: calls per contender before timing ...
    fla_rounds: int
    fla_per_round: int
    fla_time_cap_s: float  # the whole fla section (one worker process)
    opt_in_lengths: tuple[int, ...]  # precision section: prefill lengths (decode uses the decode_* counts)
    decay_lengths: tuple[int, ...]  # decay section: prefill lengths (first to last: the chunk forms' scaling)
    decay_widths: tuple[int, int, int, int]  # decay section's models: d_model, n_layers, n_heads, head_dim
    llama_lengths: tuple[int, ...]  # llamacpp section: prefill lengths (llama-bench ppL)
    llama_decode: int  # ... decode tokens per measurement (llama-bench tgN)
    llama_rounds: int  # ... rounds, alternating llama-bench and edgelin
    lowering_rounds: int  # lowering section: rounds, the two lowerings interleaved (lengths: decay_lengths)
    lowering_steps: int  # ... decode steps per measurement
    hybrid_positions: tuple[int, ...]  # hybrid section: context positions to decode at (models: decay_widths)
    hf_models: tuple[str, ...]  # transformers section: the models of transformers_eager.MODELS measured
    hf_decode: int  # ... decode tokens per measurement (from an empty state)
    hf_lengths: tuple[int, ...]  # ... prefill lengths (one call each)
    hf_rounds: int  # ... rounds, alternating which engine goes first
    genai_models: tuple[str, ...] = ("lfm2-350m", "qwen3.5-0.8b")  # genai section: models of genai.MODELS (published configurations)
    genai_precisions: tuple[str, ...] = ("fp32", "int8", "int4", "int4-table4")  # ... precisions (genai.EXPORT_OPTIONS)
    genai_threads: tuple[int, ...] = (1, 2)  # ... thread counts (and the bench's --threads)
    genai_rounds: int = 5  # ... rounds, every contender once per round in its own process, the order alternating
    genai_prompt: int = 512  # ... prompt tokens: prefill = one call of this many tokens
    genai_decode: int = 64  # ... greedy decode steps after the prompt (decode = their median step)
    decay_fla: tuple[str, ...] = ("gated_deltanet", "kda", "gated_deltaproduct", "rwkv7")  # decay section: fla's models (fla_models.FLA_MODELS)


FULL = Plan(
    decode_batches=(1, 8), decode_warmup=20, decode_rounds=10, decode_per_round=30, throughput_batches=(1, 2, 4, 8, 16, 32, 64),
    positions=(128, 1024, 4096, 16384, 65536), position_warmup=5, position_rounds=5, position_per_round=10,
    prefill_lengths=(256, 1024, 4096, 16384, 65536), piece=PREFILL_PIECE, piece_from=4096,
    case_budget_s=3.0, min_repeats=3, max_repeats=20, case_time_cap_s=20.0,
    sweep_length=4096, sweep_chunks=(16, 32, 64, 128, 256),
    bandwidth_bytes=256 << 20, bandwidth_repeats=10, floor_calls=300,
    fla_export_repeats=3, fla_warmup=3, fla_rounds=6, fla_per_round=10, fla_time_cap_s=900.0,
    opt_in_lengths=(1024, 4096), decay_lengths=(1024, 4096, 16384), decay_widths=(256, 4, 4, 64),  # the bundled model's size
    llama_lengths=(512, 4096), llama_decode=128, llama_rounds=5, lowering_rounds=3, lowering_steps=100,
    hybrid_positions=(1024, 16384, 65536),
    hf_models=("qwen3_5", "qwen3_next", "lfm2", "mamba2", "bamba", "granitemoehybrid", "nemotron_h"), hf_decode=64, hf_lengths=(128, 1024), hf_rounds=5,
)
QUICK = Plan(
    decode_batches=(1, 8), decode_warmup=3, decode_rounds=3, decode_per_round=8, throughput_batches=(1, 4),
    positions=(32, 128), position_warmup=2, position_rounds=2, position_per_round=4,
    prefill_lengths=(64, 256), piece=64, piece_from=256,
    case_budget_s=0.2, min_repeats=2, max_repeats=5, case_time_cap_s=5.0,
    sweep_length=256, sweep_chunks=(32,),
    bandwidth_bytes=32 << 20, bandwidth_repeats=3, floor_calls=30,
    fla_export_repeats=1, fla_warmup=1, fla_rounds=3, fla_per_round=2, fla_time_cap_s=600.0,
    opt_in_lengths=(64, 256), decay_lengths=(64, 256), decay_widths=(32, 1, 2, 16),
    llama_lengths=(64,), llama_decode=16, llama_rounds=1, lowering_rounds=1, lowering_steps=5,
    hybrid_positions=(64, 256),
    hf_models=("lfm2",), hf_decode=8, hf_lengths=(32,), hf_rounds=1,
    genai_models=("lfm2-tiny",), genai_precisions=("fp32", "int4"), genai_threads=(1,), genai_rounds=2, genai_prompt=64, genai_decode=8,
    decay_fla=(),  # none: one fla export costs ~15 s of CPU (the suite's budget); tests/test_bench.py builds each
)


# ---- options --------------------------------------------------------------------------------------
NOT_A_MODEL = "pass a checkpoint folder (config.json + model.safetensors) or an export folder (edgelin.json)"


def check_options(source: Any, provider: str, threads: Any, sections: Any) -> tuple[Path | nn.Module | None, tuple[str, ...]]:
    """The checked source (a folder, a model, or None) and the sections in canonical order; BenchError otherwise."""
    if provider not in PROVIDERS:
        raise BenchError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}")
    check_int("threads", threads, low=1, high=MAX_THREADS, error=BenchError)
    sections = tuple(SECTIONS if not sections else sections)
    unknown = [s for s in sections if s not in ALL_SECTIONS]
    if unknown:
        raise BenchError(f"unknown section(s) {', '.join(map(repr, unknown))}; choose from {', '.join(ALL_SECTIONS)}")
    sections = tuple(s for s in ALL_SECTIONS if s in sections)  # canonical order, no duplicates
    if source is None:
        return None, sections
    if isinstance(source, nn.Module):
        protocol.check_model(source)  # ExportError naming what is missing
        return source, sections
    path = Path(source)
    if not path.exists():
        raise BenchError(f"{path} does not exist; {NOT_A_MODEL}")
    if not path.is_dir():
        raise BenchError(f"{path} is not a folder; {NOT_A_MODEL}")
    if not (path / MANIFEST_FILE).is_file() and not (path / "config.json").is_file():
        raise BenchError(f"{path} is neither a checkpoint folder (config.json + model.safetensors) nor an export folder (edgelin.json)")
    return path, sections


MAX_MEMORY_CAP_GB = 1e6  # a petabyte: a larger cap is a typo (1e300 overflowed the byte count)


def memory_cap(memory_cap_gb: Any) -> int:
    """Bytes: prefill cases predicted to need more are skipped (default: half the available memory)."""
    if memory_cap_gb is None:
        return int((meminfo("MemAvailable") or (16 << 30)) // 2)
    check_number("memory cap", memory_cap_gb, low=0, high=MAX_MEMORY_CAP_GB, open_low=True, hint="GB", error=BenchError)
    return int(memory_cap_gb * 1e9)


def _probe_graph() -> bytes:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10).SerializeToString()


def require_cuda() -> None:
    """ProviderError (from the runtime's session factory) unless ONNX Runtime really runs a one-node graph
    on CUDA here: onnxruntime-gpu lists CUDA even without a GPU."""
    with tempfile.TemporaryDirectory(prefix="edgelin-cuda-probe-") as work:
        path = Path(work) / "probe.onnx"
        path.write_bytes(_probe_graph())
        open_session(path, "cuda")


def cuda_is_active() -> bool:
    try:
        require_cuda()
    except EdgelinError:
        return False
    return True


# ---- the model under test -------------------------------------------------------------------------
@dataclass
class Subject:
    """The model being measured, where its export comes from, and how to describe it."""

    model: nn.Module  # follows edgelin.protocol (eval mode); a LinearLM also gets the softmax twin and the O(T^2) form
    label: str  # e.g. "random weights (default-size LinearLM, seed 0)"
    random_weights: bool
    export_dir: Path | None  # a given export, else None (exported here)
    opset: int

    @property
    def is_linear_lm(self) -> bool:
        return isinstance(self.model, LinearLM)

    def config(self) -> dict[str, Any]:
        return self.model.model_config()

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _random_model(cfg: ModelConfig) -> LinearLM:
    torch.manual_seed(MODEL_SEED)
    return LinearLM(cfg).float().eval()


def _model_of_manifest(manifest: Manifest, source: Path) -> nn.Module:
    """Random weights of the architecture an export's manifest records: a LinearLM's config, or an imported
    checkpoint's own config (``source_config``) built by its importer."""
    model = manifest.model
    if "source_config" not in model:
        try:
            cfg = ModelConfig.from_dict(model)
        except ConfigError:
            raise BenchError(f"{source}: its model is neither a LinearLM nor an imported checkpoint (the manifest has no "
                             "source_config), so the bench cannot build it for the PyTorch rows; bench the module itself "
                             "from Python: edgelin.bench.run_bench(model)") from None
        return _random_model(cfg)
    from edgelin.importers import model_from_config

    torch.manual_seed(MODEL_SEED)
    return model_from_config(model["source_config"], f"{source / MANIFEST_FILE} (its model's source_config)").float().eval()


def resolve_subject(source: Path | nn.Module | None) -> Subject:
    """The model to measure: a given model, an export folder, a checkpoint folder, the bundled model, or the
    default random model."""
    if isinstance(source, nn.Module):
        return Subject(source.eval(), f"{type(source).__name__} given in Python", False, None, DEFAULT_OPSET)
    if source is not None and (source / MANIFEST_FILE).is_file():
        manifest = Manifest.load(source)
        return Subject(_model_of_manifest(manifest, source), f"export {source} (ORT rows run its graphs; PyTorch and baseline rows use random weights of its config)",
                       True, source, int(manifest.opset))
    if source is None:
        source = bundled_checkpoint()
        if source is None:
            cfg = ModelConfig(**DEFAULT_MODEL)
            return Subject(_random_model(cfg), f"random weights (default-size LinearLM {describe(cfg)}, seed {MODEL_SEED}; speed does not depend on weights)",
                           True, None, DEFAULT_OPSET)
        return Subject(load_checkpoint(source).float().eval(), f"bundled checkpoint {source.name}", False, None, DEFAULT_OPSET)
    return Subject(load_checkpoint(source).float().eval(), f"checkpoint {source}", False, None, DEFAULT_OPSET)


def describe(cfg: ModelConfig) -> str:
    return f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads x {cfg.head_dim}, vocab {cfg.vocab_size}, {cfg.feature_map}, chunk {cfg.chunk_size}"


__all__ = ["ALL_SECTIONS", "BenchError", "DATA_SEED", "FULL", "OPT_IN_SECTIONS", "PROVIDERS", "Plan", "QUICK", "SECTIONS", "Subject", "check_options",
           "cuda_is_active", "memory_cap", "require_cuda", "resolve_subject"]
