"""transformers' ``jamba`` (JambaForCausalLM, dense: one MLP per layer) on the skeleton, as transformers 5.x
computes it:

- blocks: x + mixer(input_layernorm(x)), then + SwiGLU(pre_ff_layernorm(.)) (gate_proj / up_proj / down_proj);
  final norm ``final_layernorm``; plain RMSNorms of epsilon ``rms_norm_eps``
- attention layers (i % attn_layer_period == attn_layer_offset): grouped heads, scale head_dim^-0.5, no position
  encoding, no q/k norm, no biases
- Mamba layers (the others): edgelin.layers.mamba's Mamba-1 mixer with the ``mamba_*`` sizes and RMSNorms with learned
  weights on dt (before dt_proj), B and C, of epsilon ``rms_norm_eps``
- layer i holds a mixture of experts when num_experts > 1 and i % expert_layer_period == expert_layer_offset:
  refused (edgelin imports the dense configurations only)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import check_fields
from edgelin.importers.hf import attention_heads, declare_context, time_step_rank
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.mamba import MambaMixer, MambaOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM


FIELDS: dict[str, Any] = {  # JambaConfig's fields and defaults (transformers 5.x)
    "vocab_size": 65536, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "num_experts": 16, "num_local_experts": None, "expert_layer_period": 2, "expert_layer_offset": 1,
    "attn_layer_period": 8, "attn_layer_offset": 4,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": "auto", "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    # the router's (read only with experts, which are refused), training losses, dropout, a deprecated switch and
    # training-time scan choices: no effect on a dense model's inference
    "num_experts_per_tok": 2, "output_router_logits": False, "router_aux_loss_coef": 0.001, "attention_dropout": 0.0,
    "use_mamba_kernels": True, "use_mambapy": False, "use_associative_scan": True,
}


def load(path: str | Path) -> CausalLM:
    """A ``jamba`` checkpoint folder (JambaForCausalLM) without mixture-of-experts layers."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/jamba", where=path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))  # the MLP's and the Mamba conv's activation
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    experts_field = "num_local_experts" if source.get("num_local_experts") is not None else "num_experts"  # (an alias)
    experts = f.integer(experts_field)
    period, offset = f.integer("expert_layer_period"), f.get("expert_layer_offset")
    attn_period, attn_offset = f.integer("attn_layer_period"), f.get("attn_layer_offset")
    for name, value, bound in (("expert_layer_offset", offset, period), ("attn_layer_offset", attn_offset, attn_period)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise f.fail(name, f"must be an integer in 0..{bound - 1} (below its period), got {value!r}")
    moe = [i for i in range(n_layers) if experts > 1 and i % period == offset]
    if moe:
        raise f.unsupported(experts_field, f"is {experts}, which gives layers {moe[:8]} a mixture of experts "
                            f"(expert_layer_period {period}, expert_layer_offset {offset}); edgelin imports dense Jamba models "
                            f"(num_experts 1) only")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    attention = AttentionOptions(d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=0,
                                 norm_eps=eps)
    mamba = MambaOptions(
        d_model=hidden, inner=f.integer("mamba_expand") * hidden, state_size=f.integer("mamba_d_state"),
        dt_rank=time_step_rank(f, "mamba_dt_rank", hidden), conv_kernel=f.integer("mamba_d_conv"),
        conv_bias=f.flag("mamba_conv_bias"), bias=f.flag("mamba_proj_bias"), bcdt_norm="learned", bcdt_eps=eps,
    )
    is_attention = [i % attn_period == attn_offset for i in range(n_layers)]
    tie, vocab, mlp = f.flag("tie_word_embeddings"), f.integer("vocab_size"), f.integer("intermediate_size")

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if is_attention[i] else MambaMixer(mamba), n_layers=n_layers, vocab_size=vocab,
            d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            config={"family": "hf/jamba", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, source, any(is_attention))

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.final_layernorm.", "norm."),
        (".input_layernorm.", ".attn_norm."), (".pre_ff_layernorm.", ".mlp_norm."),
        (".feed_forward.gate_proj.", ".mlp.gate."), (".feed_forward.up_proj.", ".mlp.up."),
        (".feed_forward.down_proj.", ".mlp.down."),
        (".mamba.", ".attn."), (".self_attn.", ".attn."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


__all__ = ["FIELDS", "load"]
