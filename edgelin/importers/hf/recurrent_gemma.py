"""transformers' ``recurrent_gemma`` (RecurrentGemmaForCausalLM: RecurrentGemma, Griffin) on the skeleton, as
transformers 5.x computes it:

- embeddings times sqrt(hidden_size) rounded to bfloat16 (transformers' ``normalizer`` buffer is a bfloat16
  tensor cast to the activations' dtype: 5.65625 for hidden 32, 50.5 for 2560)
- blocks: x + temporal_block(temporal_pre_norm(x)), then + mlp_block(channel_pre_norm(.)); every norm (and
  ``final_norm``) is Gemma's x / rms(x) * (1 + w) (``UnitOffsetRMSNorm``)
- ``block_types`` cycled over the layers: "recurrent" layers are Griffin's recurrent block with its RG-LRU (mixer
  ``rg_lru``, edgelin.layers.rg_lru); "attention" layers are local softmax attention (mixer ``attention``): a
  sliding window of ``attention_window_size`` positions (each query sees itself and the W - 1 before it), grouped
  heads (``num_key_value_heads``), head_dim = ``head_dim`` or hidden / heads, RoPE by halves on the first
  head_dim * partial_rotary_factor features (default 0.5), optional q/k/v biases, a bias on o_proj always
- the MLP: down(gelu_tanh(gate(x)) * up(x)) with biases, of width intermediate_size // 2 (``GeGLU``)
- logits = c tanh(logits / c), c = ``logits_soft_cap``; tied embeddings by default
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, read_rope
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.mlp import GeGLU
from edgelin.layers.norms import UnitOffsetRMSNorm
from edgelin.layers.rg_lru import RGLRUBlock, RGLRUOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # RecurrentGemmaConfig's fields and defaults (transformers 5.x), and what save_pretrained adds
    "num_hidden_layers": 26, "vocab_size": 256000, "hidden_size": 2560, "intermediate_size": 3 * 2560, "num_attention_heads": 10,
    "lru_width": None, "attention_window_size": 2048, "sliding_window": None, "conv1d_width": 4, "logits_soft_cap": 30.0,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "block_types": ["recurrent", "recurrent", "attention"],
    "num_key_value_heads": None, "attention_bias": False, "tie_word_embeddings": True, "head_dim": None,
    "rope_parameters": None, "rope_theta": None, "partial_rotary_factor": None, "rope_scaling": None,
}
# Read by transformers' initialisation or training only, or not at all by its model: the same model whatever they hold.
UNREAD_FIELDS = (
    "w_init_variance_scale", "final_w_init_variance_scale",  # the initial weights' scales
    "attention_dropout",  # dropout in training; edgelin runs inference
    "embeddings_scale_by_sqrt_dim",  # older configs; transformers' model scales the embeddings whatever it says
)
ACTIVATIONS = ("gelu_pytorch_tanh",)
BLOCK_TYPES = ("recurrent", "attention")


def embed_scale(hidden: int) -> float:
    """sqrt(hidden) as transformers' bfloat16 ``normalizer`` holds it."""
    return float(torch.tensor(hidden**0.5, dtype=torch.bfloat16))


def read_block_types(f: Fields, n_layers: int) -> list[str]:
    """``block_types`` cycled over ``n_layers`` layers (transformers' ``layers_block_type``)."""
    kinds = f.get("block_types")
    if not isinstance(kinds, list) or not kinds or any(k not in BLOCK_TYPES for k in kinds):
        raise f.fail("block_types", f"must be a non-empty list of 'recurrent' and 'attention', got {str(kinds)[:80]}")
    return [kinds[i % len(kinds)] for i in range(n_layers)]


def read_window(f: Fields) -> int:
    """``attention_window_size`` (transformers maps ``sliding_window`` onto it)."""
    window, alias = f.get("attention_window_size"), f.get("sliding_window")
    if alias is not None and "attention_window_size" in f.data and alias != window:
        raise f.fail("sliding_window", f"({alias!r}) names attention_window_size ({window!r}) and disagrees with it; keep one")
    return f.integer("sliding_window" if alias is not None else "attention_window_size")


def load(path: str | Path) -> CausalLM:
    """A ``recurrent_gemma`` checkpoint folder (RecurrentGemmaForCausalLM)."""
    ckpt = open_checkpoint(path)
    path, source = ckpt.path, ckpt.config
    defaults = {**FIELDS, **{name: None for name in UNREAD_FIELDS}}
    f = check_fields(source, defaults=defaults, refused={}, importer="hf/recurrent_gemma", where=path / CONFIG_FILE)
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    theta, rotary = read_rope(f, head_dim, importer="hf/recurrent_gemma", default_theta=10000.0, default_factor=0.5)
    kinds = read_block_types(f, n_layers)
    if f.get("hidden_activation") not in ACTIVATIONS:
        said = ", ".join(map(repr, ACTIVATIONS))
        raise f.unsupported("hidden_activation", f"is {f.get('hidden_activation')!r}; edgelin supports {said} (GELU's tanh form)")
    lru = f.integer("lru_width", optional=True) or hidden
    if lru % heads:
        raise f.fail("lru_width", f"({lru}) must be a multiple of num_attention_heads ({heads}): the RG-LRU gates' blocks")
    mlp = f.integer("intermediate_size") // 2
    if mlp < 1:
        raise f.fail("intermediate_size", "must be at least 2: the MLP's width is intermediate_size // 2")
    cap, tie, vocab = f.number("logits_soft_cap"), f.flag("tie_word_embeddings"), f.integer("vocab_size")
    attention = AttentionOptions(
        d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rotary_dim=rotary,
        window=read_window(f), qkv_bias=f.flag("attention_bias"), o_bias=True, norm_eps=eps,
    )
    recurrent = RGLRUOptions(d_model=hidden, lru_width=lru, num_heads=heads, conv_width=f.integer("conv1d_width"))

    def make() -> CausalLM:
        return CausalLM(
            lambda i: Attention(attention) if kinds[i] == "attention" else RGLRUBlock(recurrent),
            n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie,
            chunk_size=DEFAULT_CHUNK,
            config={"family": "hf/recurrent_gemma", "chunk_size": DEFAULT_CHUNK, "source_config": source},
            norm=UnitOffsetRMSNorm, mlp=GeGLU, embed_scale=embed_scale(hidden), logits_softcap=cap,
        )

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.final_norm.", "norm."),
        (".temporal_pre_norm.", ".attn_norm."), (".channel_pre_norm.", ".mlp_norm."),
        (".mlp_block.gate_proj.", ".mlp.gate."), (".mlp_block.up_proj.", ".mlp.up."), (".mlp_block.down_proj.", ".mlp.down."),
        (".temporal_block.rg_lru.", ".attn."), (".temporal_block.", ".attn."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


__all__ = ["FIELDS", "UNREAD_FIELDS", "embed_scale", "load"]
