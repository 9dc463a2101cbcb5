"""transformers' ``falcon_h1`` (FalconH1ForCausalLM) on the skeleton, as transformers 5.x computes it:

- every block: h = input_layernorm(x); x + ssm_out * mamba(ssm_in * h) + attn_out * attention(attn_in * h), then
  + down_mult * down_proj(silu(gate_mult * gate_proj(.)) * up_proj(.)) over pre_ff_layernorm(.); final norm
  ``final_layernorm``; plain RMSNorms (epsilon rms_norm_eps)
- the two mixers run side by side (edgelin.layers.parallel, members "mamba" then "attention") on the same normed input
- Mamba2 (edgelin.layers.mamba2): inner width ``mamba_d_ssm`` (or mamba_expand x hidden_size), the in_proj output
  times the per-segment vector of ``ssm_multipliers`` (z, x, B, C, dt: transformers' compute_mup_vector), the gated
  norm optional (``mamba_rms_norm``) and before the gate by default (``mamba_norm_before_gate``), in_proj's bias
  ``mamba_proj_bias``, out_proj's ``projectors_bias``
- attention: grouped heads, scale head_dim^-0.5, RoPE by halves over the whole head (transformers' Falcon-H1 reads
  no partial rotary factor), keys times ``key_multiplier`` before RoPE, biases ``attention_bias``
- logits = lm_head(h) * lm_head_multiplier; embeddings times embedding_multiplier

Every multiplier is folded into the weights it multiplies at load time (a scale on a linear layer's input or output
is exact up to rounding): ssm_in_multiplier and the mup vector into in_proj (the vector into its bias too),
ssm_out_multiplier into out_proj, attention_in_multiplier into q/k/v_proj's weights, key_multiplier into k_proj,
attention_out_multiplier into o_proj, mlp_multipliers into gate_proj and down_proj, embedding_multiplier into the
embedding and lm_head_multiplier into lm_head. With tied embeddings the two last stay in the graph (the skeleton's
embed_scale and logits_scale = 1 / lm_head_multiplier): one matrix cannot carry both.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, declare_context, mamba_options, read_rope
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.mamba2 import Mamba2Mixer
from edgelin.layers.parallel import Parallel
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # FalconH1Config's fields and defaults (transformers 5.x)
    "vocab_size": 128000, "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "mamba_d_ssm": 1024, "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256,
    "mamba_d_conv": 4, "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_norm_before_gate": True,
    "mamba_rms_norm": False, "time_step_limit": [0.0, float("inf")], "projectors_bias": False, "rope_parameters": None,
    "lm_head_multiplier": 1.0, "embedding_multiplier": 1.0, "mlp_multipliers": None, "key_multiplier": 1.0,
    "attention_out_multiplier": 1.0, "attention_in_multiplier": 1.0, "ssm_multipliers": None, "ssm_in_multiplier": 1.0,
    "ssm_out_multiplier": 1.0, "attention_bias": False, "mlp_bias": False,
    # read as transformers reads them though FalconH1Config does not declare them (getattr, or transformers' rope
    # standardisation of older configs)
    "head_dim": None, "rope_theta": None, "rope_scaling": None, "partial_rotary_factor": None,
    # older configs: transformers' Falcon-H1 always has the MLP (refused below when false)
    "mamba_use_mlp": True,
    # no effect at inference: a kernel's block size, the logits kept in generation, dropout
    "mamba_chunk_size": 256, "num_logits_to_keep": 1, "attention_dropout": 0.0,
}
MEMBERS = ("mamba", "attention")  # the parallel layer's members, in the order of their states


def _multipliers(f: Fields, name: str, count: int) -> list[float]:
    """A list of ``count`` positive finite multipliers (transformers' default when null: all 1)."""
    values = f.get(name)
    if values is None:
        return [1.0] * count
    if not isinstance(values, (list, tuple)) or len(values) != count or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v) for v in values
    ):
        raise f.fail(name, f"must list {count} positive finite numbers, got {str(values)[:80]}")
    return [float(v) for v in values]


def mup_vector(z: float, x: float, b: float, c: float, dt: float, *, inner: int, groups_state: int, heads: int) -> torch.Tensor:
    """transformers' compute_mup_vector: one factor per in_proj output row, by segment [z: I | x: I | B: G N | C: G N |
    dt: H] -> [2 I + 2 G N + H] float32."""
    sizes = (inner, inner, groups_state, groups_state, heads)
    return torch.cat([torch.full((n,), v, dtype=torch.float32) for n, v in zip(sizes, (z, x, b, c, dt))])


def load(path: str | Path) -> CausalLM:
    """A ``falcon_h1`` checkpoint folder (FalconH1ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/falcon_h1", where=path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))
    if f.flag("mlp_bias"):
        raise f.unsupported("mlp_bias", "is true (biases on the MLP's projections); edgelin's falcon_h1 importer supports false "
                                        "only")
    if f.get("mamba_use_mlp") is not True:
        raise f.fail("mamba_use_mlp", "is not true; transformers' Falcon-H1 always has an MLP in every layer: set it to true or "
                                      "remove it")
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    theta, _ = read_rope(f, head_dim, importer="hf/falcon_h1", default_theta=10000.0)  # RoPE over the whole head (docstring)
    bias, d_ssm = f.flag("attention_bias"), f.integer("mamba_d_ssm", optional=True)
    attention = AttentionOptions(d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                                 qkv_bias=bias, o_bias=bias, norm_eps=eps)
    mamba = mamba_options(f, hidden, d_ssm=d_ssm, rms_norm=f.flag("mamba_rms_norm"),
                          norm_before_gate=f.flag("mamba_norm_before_gate"), out_bias=f.flag("projectors_bias"))
    scales = {name: f.number(name) for name in (
        "embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier", "key_multiplier",
        "ssm_in_multiplier", "ssm_out_multiplier")}
    gate_mult, down_mult = _multipliers(f, "mlp_multipliers", 2)
    mup = mup_vector(*_multipliers(f, "ssm_multipliers", 5), inner=mamba.inner, groups_state=mamba.n_groups * mamba.state_size,
                     heads=mamba.num_heads)
    tie, vocab, mlp = f.flag("tie_word_embeddings"), f.integer("vocab_size"), f.integer("intermediate_size")

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Parallel({"mamba": Mamba2Mixer(mamba), "attention": Attention(attention)}), n_layers=n_layers,
            vocab_size=vocab, d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            embed_scale=scales["embedding_multiplier"] if tie else 1.0,
            logits_scale=1.0 / scales["lm_head_multiplier"] if tie else 1.0,
            config={"family": "hf/falcon_h1", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, source, True)

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.final_layernorm.", "norm."),
        (".input_layernorm.", ".attn_norm."), (".pre_ff_layernorm.", ".mlp_norm."),
        (".feed_forward.gate_proj.", ".mlp.gate."), (".feed_forward.up_proj.", ".mlp.up."),
        (".feed_forward.down_proj.", ".mlp.down."),
        (".mamba.", ".attn.members.mamba."), (".attn.members.mamba.norm.", ".attn.members.mamba.gate_norm_"),  # the gated norm
        (".self_attn.", ".attn.members.attention."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    model = load_checkpoint_weights(ckpt, make, Renamer(pairs))
    with torch.no_grad():
        fold(model, scales, gate_mult, down_mult, mup, tie)
    return model


def fold(model: CausalLM, scales: dict[str, float], gate_mult: float, down_mult: float, mup: torch.Tensor, tie: bool) -> None:
    """Multiply the multipliers into the weights they scale (module docstring), in place."""
    for block in model.blocks:
        mamba, attention = (block.attn.members[name] for name in MEMBERS)
        mamba.in_proj.weight.mul_((mup * scales["ssm_in_multiplier"])[:, None])  # mup * in_proj(ssm_in * h)
        if mamba.in_proj.bias is not None:
            mamba.in_proj.bias.mul_(mup)
        scale(mamba.out_proj, scales["ssm_out_multiplier"])
        attention.q_proj.weight.mul_(scales["attention_in_multiplier"])
        attention.k_proj.weight.mul_(scales["attention_in_multiplier"] * scales["key_multiplier"])
        if attention.k_proj.bias is not None:
            attention.k_proj.bias.mul_(scales["key_multiplier"])
        attention.v_proj.weight.mul_(scales["attention_in_multiplier"])
        scale(attention.o_proj, scales["attention_out_multiplier"])
        scale(block.mlp.gate, gate_mult)
        scale(block.mlp.down, down_mult)
    if not tie:
        model.embed.weight.mul_(scales["embedding_multiplier"])
        model.lm_head.weight.mul_(scales["lm_head_multiplier"])


def scale(linear: torch.nn.Linear, factor: float) -> None:
    """linear(x) * factor as a linear layer: its weight and bias times factor."""
    linear.weight.mul_(factor)
    if linear.bias is not None:
        linear.bias.mul_(factor)


__all__ = ["FIELDS", "load", "mup_vector"]
