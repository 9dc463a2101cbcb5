"""The Hugging Face checkpoints the bench builds with transformers' own classes, and their checked export.

One small model per importer family (``FAMILIES``: Qwen3.5, Qwen3-Next with dense MLPs, LFM2, Mamba2, Bamba,
Granite-4.0-H, Nemotron-H; then LFM3, OLMo-hybrid, Falcon-H1, Zamba2, RecurrentGemma, Mamba and Jamba, which no plan's
``hf_models`` names, so that the test suite builds none of them), each of the bundled model's weight size (hidden
256, 4 layers) in its family's layer pattern (the later seven with their special token ids inside the vocabulary).
``build_checkpoint`` makes one in a subprocess (``python -m edgelin.bench --hf-build SPEC``, triton and fla hidden so
that transformers takes its PyTorch paths, as on a CPU-only device): random weights perturbed so the logits spread
(``perturb``), saved with a byte-level BPE tokenizer (``byte_level_tokenizer``). The llamacpp section measures LFM2
and Mamba2, the transformers section the models its plan's ``hf_models`` names; scripts/ (hf_product_check,
precision_floor, train_hf_tiny) take any of them.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path
from typing import Any, Callable

from .harness import run_command
from .plan import MODEL_SEED, BenchError

VOCAB = 512  # a byte-level tokenizer: the 256 bytes, then 256 merges of two letters (llama.cpp refuses a BPE without merges)
TIMEOUT = 1800.0  # seconds for building one checkpoint
_QWEN = {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "tie_word_embeddings": False}  # 3 Gated DeltaNet + attention
_MAMBA_HYBRID = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2,
                 "tie_word_embeddings": False}
_SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside VOCAB (some configs' defaults are not)
FAMILIES = {  # name -> (transformers model_type, config): the bundled model's weight size, each family's layer pattern
    "qwen3_5": ("qwen3_5_text", _QWEN),
    "qwen3_next": ("qwen3_next", {**_QWEN, "num_experts": 0}),
    "lfm2": ("lfm2", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "conv", "full_attention", "conv"],
                      "tie_word_embeddings": False}),  # tied random weights: greedy would repeat the last token
    "mamba2": ("mamba2", {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 4, "expand": 2, "num_heads": 8,
                          "head_dim": 64, "n_groups": 1, "state_size": 64, "conv_kernel": 4}),
    "bamba": ("bamba", {**_MAMBA_HYBRID, "intermediate_size": 768, "attn_layer_indices": [3]}),
    "granitemoehybrid": ("granitemoehybrid", {**_MAMBA_HYBRID, "shared_intermediate_size": 768, "num_local_experts": 0,
                                              "layer_types": ["mamba", "mamba", "mamba", "attention"],
                                              "position_embedding_type": "rope"}),
    "nemotron_h": ("nemotron_h", {"vocab_size": VOCAB, "hidden_size": 256, "hybrid_override_pattern": "M-M-*-", "intermediate_size": 768,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_num_heads": 8,
                                  "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 1, "conv_kernel": 4}),
    # the families below are in no plan's hf_models (bench.plan): the test suite builds none of them; scripts/ and the
    # transformers section (when a plan names them) do
    "lfm3": ("lfm3", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128,
                      "layer_types": ["conv", "sliding_attention", "full_attention", "conv"], "use_sandwich_norm": True,
                      "use_attention_gate": True, "tie_word_embeddings": False, **_SPECIAL}),  # a window shorter than validate's texts
    "olmo_hybrid": ("olmo_hybrid", {**_QWEN, "layer_types": ["linear_attention"] * 3 + ["full_attention"], **_SPECIAL}),
    "falcon_h1": ("falcon_h1", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "mamba_d_ssm": 512,
                                "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_d_state": 64, "mamba_d_conv": 4,
                                "mamba_rms_norm": True, "tie_word_embeddings": False, **_SPECIAL,
                                # every μP multiplier away from 1 (the importer folds them into the weights)
                                "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "attention_in_multiplier": 1.3,
                                "attention_out_multiplier": 0.8, "key_multiplier": 1.5, "ssm_in_multiplier": 0.6,
                                "ssm_out_multiplier": 1.4, "ssm_multipliers": [0.5, 1.5, 0.7, 1.3, 0.9], "mlp_multipliers": [1.2, 0.75]}),
    "zamba2": ("zamba2", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                          "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "num_mem_blocks": 1,  # one shared block
                          "use_shared_attention_adapter": True, "adapter_rank": 16, "use_mem_rope": True,
                          "num_attention_heads": 4, "n_mamba_heads": 8, "mamba_ngroups": 1, "mamba_d_state": 64,
                          "tie_word_embeddings": True, **_SPECIAL}),  # tied, as transformers shares the block only then
    "recurrent_gemma": ("recurrent_gemma", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 1536,  # MLP of 768
                                            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1,
                                            "block_types": ["recurrent", "recurrent", "attention"], "attention_window_size": 128,
                                            "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}),
    "mamba": ("mamba", {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 4, "state_size": 16, "expand": 2,
                        "conv_kernel": 4}),  # transformers' defaults: tied, dt rank auto
    "jamba": ("jamba", {"vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 1,  # dense: Jamba's MoE is refused
                        "attn_layer_period": 4, "attn_layer_offset": 3, "mamba_d_state": 16, "mamba_d_conv": 4,
                        "mamba_expand": 2, **_SPECIAL}),
}


# Published configurations (config.json of the released checkpoints), text model only: scripts/real_size.py and the
# genai section build them at real size with random weights.
LFM2_350M = {
    "vocab_size": 65536, "hidden_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
    "intermediate_size": 6656, "block_ff_dim": 6656, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": True, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3, "conv_bias": False,
    "norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "max_position_embeddings": 128000,
    "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0,
}
# Qwen/Qwen3.5-4B text_config, as quoted by a public test fixture of its config.json (eos 248044, tied)
QWEN35_4B = {
    "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 256, "intermediate_size": 9216, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 262144, "eos_token_id": 248044,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
PUBLISHED = {  # name -> (transformers model_type, config)
    "lfm2-350m": ("lfm2", LFM2_350M),
    "qwen3.5-0.8b": ("qwen3_5_text", {
        "vocab_size": 248320, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 256, "intermediate_size": 3584, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }),
    "qwen3.5-4b": ("qwen3_5_text", QWEN35_4B),
    # Qwen/Qwen3.5-9B: hidden 4096, 16 query / 4 key-value heads of 256, intermediate 12288 as public shape notes quote
    # them; layers, linear heads (16 key / 32 value of 128) are transformers' Qwen3_5TextConfig defaults (the 9B's);
    # untied embeddings, rope and the rest follow the family's other sizes: not seen in a published config.json here
    "qwen3.5-9b": ("qwen3_5_text", {**QWEN35_4B, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False}),
    # LiquidAI/LFM2-8B-A1B config.json as public test fixtures quote it (its layer_types, 32 experts, top 4, 2 dense layers)
    "lfm2-8b-a1b": ("lfm2_moe", {
        "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
        "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 128000,
        "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2, "num_experts": 32,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "use_expert_bias": True, "routed_scaling_factor": 1.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 7, "pad_token_id": 0,
        "layer_types": ["conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
                        "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention",
                        "conv", "conv", "full_attention", "conv", "conv"],
    }),
}


def perturb(model: Any, seed: int, large: Callable[[str], bool]) -> None:
    """Spread a random model's logits over a few units (a fresh init gives near-constant logits, against which a parity
    check would prove little): norm weights 1 + 0.3 N(0, 1), parameters ``large(name)`` picks + 0.3 N(0, 1), the
    others + 0.05 N(0, 1), drawn in parameter order from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.add_((0.3 if large(name) else 0.05) * torch.randn(p.shape, generator=gen))


def hf_build_main(spec: dict[str, Any]) -> None:
    """In ``python -m edgelin.bench --hf-build SPEC``: transformers' own model from the config, weights perturbed so
    the logits spread, saved with a byte-level BPE tokenizer of the config's vocabulary beside it (the 256 bytes, then
    merges of two symbols)."""
    sys.modules["triton"] = None  # type: ignore[assignment]  # transformers' PyTorch paths (NOTES: CPU-only machine)
    sys.modules["fla"] = None  # type: ignore[assignment]
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(spec["model_type"], **spec["config"])
    torch.manual_seed(MODEL_SEED)
    model = getattr(transformers, spec.get("auto_class", "AutoModelForCausalLM")).from_config(cfg).float().eval()
    perturb(model, MODEL_SEED + 1, lambda name: "embed" in name or "lm_head" in name or name.endswith(("A_log", "dt_bias")))
    model.save_pretrained(spec["folder"])
    tok = byte_level_tokenizer(spec["config"].get("vocab_size", VOCAB))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(spec["folder"])


def byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly ``vocab_size`` tokens (a ``tokenizers.Tokenizer``): the 256 byte symbols, then merges
    of two symbols (pairs of 16 letters up to VOCAB; beyond it, pairs of all 256 symbols: up to 65,792 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pool = "abcdefghijklmnop" if vocab_size <= VOCAB else alphabet
    merges = [(a, b) for a in pool for b in pool][: vocab_size - len(alphabet)]
    if len(alphabet) + len(merges) != vocab_size:
        raise BenchError(f"a byte-level tokenizer of {vocab_size:,} tokens cannot be made here (256 to {len(alphabet) * (len(alphabet) + 1):,})")
    vocab = {c: i for i, c in enumerate(alphabet + [a + b for a, b in merges])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return tok


def build_checkpoint(name: str, folder: Path, models: dict[str, tuple[str, dict]] | None = None,
                     auto_class: str = "AutoModelForCausalLM") -> Path:
    """Model ``name`` of ``models`` (default: FAMILIES) built by transformers' ``auto_class`` and saved, in a subprocess."""
    model_type, config = (FAMILIES if models is None else models)[name]
    spec = {"model_type": model_type, "config": config, "folder": str(folder)}
    if auto_class != "AutoModelForCausalLM":
        spec["auto_class"] = auto_class
    run_command([sys.executable, "-m", "edgelin.bench", "--hf-build", json.dumps(spec)], f"building the {name} checkpoint", BenchError, TIMEOUT)
    return folder


def export_checked(ckpt: Path, out: Path, options: str | dict[str, Any], trace_cache: Path | None = None,
                   facts: dict[str, Any] | None = None) -> str:
    """Export with the exporter's check against PyTorch; where the check fails, export unchecked and say so (the
    greedy ids then show what the difference does): "passed" or the check's failure. ``options``: a precision or the
    export's options. ``trace_cache``: a folder shared by the exports of one checkpoint, so that its precisions (and
    an unchecked retry) trace it once. ``facts``: given, it receives the export's ``peak_own_bytes`` (its largest anonymous
    resident memory)."""
    from edgelin.errors import ExportError
    from edgelin.exporters import export

    options = {"precision": options} if isinstance(options, str) else dict(options)
    if trace_cache is not None:
        options["trace_cache"] = trace_cache
    check = "passed"
    try:
        result = export(ckpt, out, **options)
    except ExportError as exc:
        check = f"failed, exported unchecked: {exc}"
    if check != "passed":
        # retried outside the handler, after a collection: the failed attempt's frames and its model (mapped from a
        # scratch file the size of the model in float32, whose disk space the mapping holds) are let go first
        gc.collect()
        result = export(ckpt, out, **options, check=False)
    if facts is not None:
        facts["peak_own_bytes"] = getattr(result, "peak_own_bytes", None)
    return check


def export_checked_main(spec: dict[str, Any]) -> None:
    """In ``python -m edgelin.bench --export-checked SPEC``: ``export_checked`` of spec's checkpoint into its out folder with
    its options (and trace cache), the check's verdict and the export's own peak memory printed as JSON."""
    cache, facts = spec.get("trace_cache"), {}
    check = export_checked(Path(spec["checkpoint"]), Path(spec["out"]), spec["options"], None if cache is None else Path(cache), facts)
    print(json.dumps({"check": check, **facts}))


__all__ = ["FAMILIES", "LFM2_350M", "PUBLISHED", "VOCAB", "build_checkpoint", "byte_level_tokenizer", "export_checked", "export_checked_main", "hf_build_main", "perturb"]
