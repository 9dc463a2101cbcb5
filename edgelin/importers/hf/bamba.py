"""transformers' ``bamba`` (BambaForCausalLM: Mamba2 layers and attention layers, each followed by a SwiGLU MLP)
on the skeleton, as transformers 5.x computes it:

- blocks: x + mixer(input_layernorm(x)), then + SwiGLU(pre_ff_layernorm(.)) (gate_proj / up_proj / down_proj);
  final norm ``final_layernorm``; plain RMSNorms
- Mamba layers (every layer not in ``attn_layer_indices``): edgelin.layers.mamba2's mixer with the ``mamba_*`` sizes, its
  gated norm's epsilon ``rms_norm_eps`` (the same code as transformers' Mamba2Mixer)
- attention layers: grouped heads, scale head_dim^-0.5, no q/k norm, RoPE by halves on the first half of each head
  (transformers' Bamba fixes partial_rotary_factor at 0.5, whatever the config says)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import check_fields
from edgelin.importers.hf import attention_heads, declare_context, mamba_options, mixer_renames, read_rope
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.mamba2 import Mamba2Mixer
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM


BAMBA_ROTARY_FACTOR = 0.5  # transformers' BambaConfig overwrites any partial_rotary_factor with 0.5


FIELDS: dict[str, Any] = {  # BambaConfig's fields and defaults (transformers 5.x)
    "vocab_size": 128000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "attn_layer_indices": None,
    "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": [0.0, float("inf")],
    "rope_parameters": None, "rope_theta": None, "partial_rotary_factor": None,
    # no effect at inference: a kernel's block size, training losses, dropout, logits kept in training
    "mamba_chunk_size": 256, "z_loss_coefficient": 0.0, "num_logits_to_keep": 1, "attention_dropout": 0.0,
}


def load(path: str | Path) -> CausalLM:
    """A ``bamba`` checkpoint folder (BambaForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/bamba", where=path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))
    for name in ("attention_bias", "mlp_bias"):
        if f.flag(name):
            raise f.fail(name, "is true; edgelin's bamba importer supports false only")
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    theta, _ = read_rope(f, head_dim, importer="hf/bamba", default_theta=10000.0)
    rotary = int(head_dim * BAMBA_ROTARY_FACTOR)
    idxs = f.get("attn_layer_indices") or []
    if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in idxs):
        raise f.fail("attn_layer_indices", f"must list layer indices in 0..{n_layers - 1}, got {str(idxs)[:80]}")
    mamba = mamba_options(f, hidden)
    attention = AttentionOptions(d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                                 rope_theta=theta, rotary_dim=rotary, norm_eps=eps)
    tie, vocab, mlp = f.flag("tie_word_embeddings"), f.integer("vocab_size"), f.integer("intermediate_size")

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if i in idxs else Mamba2Mixer(mamba), n_layers=n_layers, vocab_size=vocab,
            d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            config={"family": "hf/bamba", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, source, bool(idxs))

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.final_layernorm.", "norm."),
        (".input_layernorm.", ".attn_norm."), (".pre_ff_layernorm.", ".mlp_norm."),
        (".feed_forward.gate_proj.", ".mlp.gate."), (".feed_forward.up_proj.", ".mlp.up."), (".feed_forward.down_proj.", ".mlp.down."),
        *mixer_renames("mamba"), (".self_attn.", ".attn."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


__all__ = ["FIELDS", "load", "mamba_options"]
