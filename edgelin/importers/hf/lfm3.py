"""transformers' ``lfm3`` (Lfm3ForCausalLM) on the skeleton, as transformers 5.x computes it:

- blocks: x + post_norm(mixer(operator_norm(x))), then + post_norm(SwiGLU(ffn_norm(.))) with w1 = gate, w3 = up,
  w2 = down: sandwich norms (``post_operator_norm``, ``post_ffn_norm``) on every layer with ``use_sandwich_norm``,
  pre-norms only without; the final norm is ``embedding_norm`` (after the last block); plain RMSNorms x / rms(x) * w
- ``conv`` layers: LFM2's gated short conv (mixer ``short_conv``) with a window of ``conv_L_cache`` taps (7 by
  default); its state ``{layer}.conv`` [B, hidden, L_cache], the last L_cache values of B * x (transformers' cache)
- ``full_attention`` and ``sliding_attention`` layers: softmax attention (mixer ``attention``) with per-head RMSNorms
  on q and k before RoPE, grouped heads, biases on q, k, v and o with ``attention_bias``, and with
  ``use_attention_gate`` the output of head h times sigmoid(g_proj(x))_h (g_proj: hidden -> heads, no bias) before
  o_proj. A sliding layer's query at position t sees the keys at t - sliding_window < s <= t (transformers' mask);
  edgelin's cache keeps the last ``sliding_window`` keys, transformers' the last sliding_window - 1 (all it needs)
- RoPE per layer type from ``rope_parameters[type]``: "default" rotates the whole head with theta^(-2i / head_dim)
  (transformers' Lfm3 default ignores partial_rotary_factor); "proportional" rotates the whole head too, with
  theta^(-2i / head_dim) for i < int(partial_rotary_factor * head_dim // 2) and frequency 0 for the other pairs
- the MLP width is ``intermediate_size`` as it is (no LFM2-style adjustment); ``head_dim`` is its own field (128 by
  default), not hidden / heads
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, declare_context, rope_object
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.short_conv import GatedShortConv
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # Lfm3Config's fields and defaults (transformers 5.24)
    "vocab_size": 128000, "hidden_size": 2048, "intermediate_size": 7680, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 128, "norm_eps": 1e-5, "rms_norm_eps": None, "tie_word_embeddings": True,
    "rope_parameters": None, "conv_bias": False, "conv_L_cache": 7, "layer_types": None, "sliding_window": 256,
    "use_sandwich_norm": True, "use_attention_gate": True, "attention_bias": False, "attention_dropout": 0.0,
}
ATTENTION_KINDS = ("full_attention", "sliding_attention")
LAYER_KINDS = ("conv", *ATTENTION_KINDS)
DEFAULT_ROPE = {  # Lfm3Config's rope_parameters when the config has none
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}


def read_layer_types(f: Fields, n_layers: int) -> list[str]:
    """``layer_types``, or Lfm3Config's default: full attention at i % 4 == 2, sliding at i % 4 == 0 (i > 0), else conv."""
    kinds = f.get("layer_types")
    if kinds is None:
        return ["full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"
                for i in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'conv', 'full_attention' or 'sliding_attention'; "
                                    f"got {str(kinds)[:80]}")
    return kinds


def read_layer_rope(f: Fields, kind: str, head_dim: int) -> tuple[float, int, bool]:
    """(rope_theta, rotary width, proportional) of the attention layers of type ``kind``: ``rope_parameters[kind]``
    as transformers' Lfm3RotaryEmbedding reads it (the module docstring)."""
    params = f.get("rope_parameters")
    params = DEFAULT_ROPE if params is None else params
    if not isinstance(params, dict) or not set(params) <= set(ATTENTION_KINDS) or kind not in params:
        raise f.fail("rope_parameters", f"must map each attention layer type ({', '.join(ATTENTION_KINDS)}) to its RoPE "
                                        f"parameters, as Lfm3Config writes it; {kind!r} has none in {str(params)[:80]}")
    entry = params[kind]
    rope_type = rope_object(f, entry, importer="hf/lfm3", types=("default", "proportional"), where=f"[{kind!r}] ",
                            extra_keys=("factor",))
    theta = entry.get("rope_theta")
    factor = entry.get("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0  # the default type ignores it
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise f.fail("rope_parameters", f"[{kind!r}] has {name} {value!r}; it must be a positive number")
    if entry.get("factor", 1.0) != 1.0:
        raise f.unsupported("rope_parameters", f"[{kind!r}] has factor {entry['factor']!r}; edgelin supports 1.0 "
                                               "(RoPE scaling is not supported)")
    if factor > 1:
        raise f.fail("rope_parameters", f"[{kind!r}] has partial_rotary_factor {factor!r}; it must be at most 1")
    return float(theta), 2 * int(factor * head_dim // 2), rope_type == "proportional"


def read_eps(f: Fields) -> float:
    """``norm_eps``; ``rms_norm_eps`` is Lfm3Config's alias of it (attribute_map)."""
    if f.get("rms_norm_eps") is None:
        return f.number("norm_eps")
    eps = f.number("rms_norm_eps")
    if "norm_eps" in f.data and f.number("norm_eps") != eps:
        raise f.fail("rms_norm_eps", f"({eps}) disagrees with norm_eps ({f.number('norm_eps')}), its alias; keep one of them")
    return eps


def load(path: str | Path) -> CausalLM:
    """An ``lfm3`` checkpoint folder (Lfm3ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/lfm3", where=path / CONFIG_FILE)
    hidden, n_layers, eps, vocab = f.integer("hidden_size"), f.integer("num_hidden_layers"), read_eps(f), f.integer("vocab_size")
    f.integer("head_dim")  # transformers' Lfm3 takes head_dim as it is (null is no fallback to hidden / heads there)
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    kinds = read_layer_types(f, n_layers)
    tie, mlp = f.flag("tie_word_embeddings"), f.integer("intermediate_size")
    taps, bias = f.integer("conv_L_cache"), f.flag("conv_bias")
    sandwich, gate, attn_bias = f.flag("use_sandwich_norm"), f.flag("use_attention_gate"), f.flag("attention_bias")
    dropout = f.get("attention_dropout")  # training only
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise f.fail("attention_dropout", f"must be a number in [0, 1], got {dropout!r}")
    window = None
    if "sliding_attention" in kinds:
        window = f.integer("sliding_window", optional=True)
        if window is None or window < 2:
            raise f.fail("sliding_window", f"must be an integer of at least 2 where layer_types has 'sliding_attention', "
                                           f"got {window!r} (transformers' cache keeps sliding_window - 1 positions)")
    options = {}
    for kind in sorted(set(kinds) & set(ATTENTION_KINDS)):
        theta, rotary, proportional = read_layer_rope(f, kind, head_dim)
        options[kind] = AttentionOptions(
            d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rotary_dim=rotary,
            proportional_rope=proportional, window=window if kind == "sliding_attention" else None, qkv_bias=attn_bias,
            o_bias=attn_bias, qk_norm=True, norm_eps=eps, head_gate=gate,
        )

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(options[kinds[i]]) if kinds[i] in options else GatedShortConv(hidden, taps, bias=bias),
            n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie,
            chunk_size=DEFAULT_CHUNK, config={"family": "hf/lfm3", "chunk_size": DEFAULT_CHUNK, "source_config": source},
            placement="sandwich" if sandwich else "pre",
        )
        return declare_context(model, source, bool(options))

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.embedding_norm.", "norm."),
        (".post_operator_norm.", ".attn_post_norm."), (".post_ffn_norm.", ".mlp_post_norm."),
        (".operator_norm.", ".attn_norm."), (".ffn_norm.", ".mlp_norm."),
        (".feed_forward.w1.", ".mlp.gate."), (".feed_forward.w3.", ".mlp.up."), (".feed_forward.w2.", ".mlp.down."),
        (".self_attn.gate_proj.", ".attn.g_proj."),  # the checkpoints' name of the module transformers calls g_proj
        (".self_attn.", ".attn."),  # q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, g_proj: the skeleton's names
        (".conv.", ".attn."),  # the conv layer's module: layers.N.conv.{in_proj, conv, out_proj}
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


__all__ = ["FIELDS", "load", "read_layer_rope", "read_layer_types"]
