"""Qwen's hybrid text model read onto the skeleton, as transformers 5.x computes it: Qwen3.5's (``qwen3_5``,
``qwen3_5_text``, ``qwen3_5_moe``, ``qwen3_5_moe_text``) and Qwen3-Next's (``qwen3_next``) importers build it from their
configs:

- blocks: x + mixer(norm(x)), then + SwiGLU(norm(.)); every RMSNorm of the stack (the blocks', the final one and
  the attention's q/k norms) is zero-centred, x / rms(x) * (1 + w) (``UnitOffsetRMSNorm``)
- ``linear_attention`` layers: Gated DeltaNet (mixer ``fla/delta`` with ``packed_qkv``): in_proj_qkv -> one
  depthwise causal conv (SiLU) over [q | k | v] -> heads (value head j reads key head j // (Nv / Nk)) -> q, k
  L2-normalised, q scaled by K^-0.5 -> the gated delta rule with beta = sigmoid(in_proj_b x) and
  g = -exp(A_log) softplus(in_proj_a x + dt_bias) -> RMSNorm(o) * w * silu(in_proj_z x) (a plain weight here)
  -> out_proj
- ``full_attention`` layers: softmax attention (mixer ``attention``) with q_proj holding per head [q_h | gate_h],
  zero-centred q/k norms before RoPE, RoPE by halves on the first head_dim * partial_rotary_factor features,
  scale head_dim^-0.5, grouped heads, o * sigmoid(gate) before o_proj. For text, Qwen3.5's multimodal RoPE
  (interleaved sections over three position rows that are equal for text tokens) is exactly 1-D RoPE.
- mixture-of-experts MLPs (``read_moe``; Qwen3.5-MoE's everywhere, Qwen3-Next's where its config says): router
  logits l = gate x (no bias), scores softmax(l), the top ``num_experts_per_tok`` chosen, their scores divided by
  their sum where the family renormalises (no epsilon, no scaling); each expert a SwiGLU of width
  ``moe_intermediate_size``; a shared SwiGLU of width ``shared_expert_intermediate_size`` times
  sigmoid(shared_expert_gate x) added to the experts' sum. The experts' weights per expert
  (``mlp.experts.{e}.gate_proj`` ..., what save_pretrained writes) or stacked as transformers holds them in memory
  (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]).
"""

from __future__ import annotations

from typing import Any

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.importers.fields import Fields
from edgelin.layers import LayerSizes
from edgelin.layers.delta import DeltaOptions, FlaDeltaAttention
from edgelin.layers.mlp import SwiGLU
from edgelin.importers.hf import declare_context, read_rope
from edgelin.importers.weights import ExpertSplit, Renamer
from edgelin.layers.moe import MoEOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM
from edgelin.layers.norms import UnitOffsetRMSNorm


TEXT_FIELDS: dict[str, Any] = {  # Qwen3_5TextConfig's fields and defaults (transformers 5.x)
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0,  # training only
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "layer_types": None, "full_attention_interval": 4,
    "rope_parameters": None, "rope_theta": None, "partial_rotary_factor": None, "rope_scaling": None,
    # in released configs, not read by transformers' model: the attention's output gate is always applied (a
    # checkpoint without one has a q_proj of half the rows, refused by shape); the SSM dtype (edgelin computes in
    # float32); the multi-token-prediction head (left out: LEFT_OUT)
    "attn_output_gate": True, "mamba_ssm_dtype": None, "mtp_num_hidden_layers": None, "mtp_use_dedicated_embeddings": None,
}


LEFT_OUT = ("model.visual.", "mtp.")  # the vision tower; the multi-token-prediction head (transformers skips it too)


LAYER_KINDS = ("linear_attention", "full_attention")


MOE_RENAMES = (  # before the others: the router (``gate``), the shared expert and its gate, each expert's SwiGLU
    (".mlp.gate.", ".mlp.router."), (".mlp.shared_expert_gate.", ".mlp.shared_gate."), (".mlp.shared_expert.", ".mlp.shared."),
    (".gate_proj.", ".gate."), (".up_proj.", ".up."), (".down_proj.", ".down."),
)


def read_moe(f: Fields, *, renormalise: bool = True) -> tuple[MoEOptions, tuple[ExpertSplit, ExpertSplit]]:
    """The mixture-of-experts MLP of the checked text config (the module docstring; ``renormalise``: the chosen
    scores divided by their sum), and the weights loader's splits of the experts' stacked layout."""
    hidden, experts, k = f.integer("hidden_size"), f.integer("num_experts"), f.integer("num_experts_per_tok")
    if k > experts:
        raise f.fail("num_experts_per_tok", f"must be at most num_experts ({experts}), got {k}")
    f.flag("output_router_logits")
    f.get("router_aux_loss_coef")
    options = MoEOptions(
        d_model=hidden, num_experts=experts, top_k=k, expert_hidden=f.integer("moe_intermediate_size"), scoring="softmax",
        renormalise=renormalise, shared_hidden=f.integer("shared_expert_intermediate_size"), shared_gate=True,
    )
    splits = (ExpertSplit("experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), experts),  # gate rows, then up
              ExpertSplit("experts.down_proj", ("down_proj.weight",), experts))
    return options, splits


def read_layer_types(f: Fields, n_layers: int) -> list[str]:
    kinds = f.get("layer_types")
    if kinds is None:
        every = f.integer("full_attention_interval")
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'linear_attention' or 'full_attention'; got {str(kinds)[:80]}")
    return kinds


def build(f: Fields, *, tie: bool | None = None, source: dict[str, Any], family: str, mlp=SwiGLU, mlp_hidden: int | None = None,
          renames: tuple[tuple[str, str], ...] = ()) -> tuple:
    """(a function that builds the model, the renames) from the checked text config ``f`` (Qwen3.5's fields, or a
    family's that reads them the same way: Qwen3-Next's). A mixture-of-experts variant gives the blocks' ``mlp``
    (CausalLM's: a function of the layer index), their ``mlp_hidden`` (else ``intermediate_size``) and ``renames``
    applied before the others."""
    f.choice("hidden_act", ("silu",))
    if f.flag("attention_bias"):
        raise f.fail("attention_bias", f"is true (biases on q/k/v/o); edgelin's {family} importer supports false only")
    f.get("attention_dropout")
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = f.integer("num_attention_heads"), f.integer("num_key_value_heads"), f.integer("head_dim")
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
    k_heads, v_heads = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    if v_heads % k_heads:
        raise f.fail("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({k_heads}), got {v_heads}")
    theta, rotary = read_rope(f, head_dim, importer=family, default_theta=10000.0, default_factor=0.25,
                              extra_keys=("mrope_section", "mrope_interleaved"))
    kinds = read_layer_types(f, n_layers)
    tie = f.flag("tie_word_embeddings") if tie is None else tie
    sizes = LayerSizes(hidden_size=hidden, norm_eps=eps)
    delta = DeltaOptions(
        gated=True, num_heads=k_heads, num_v_heads=v_heads, head_k_dim=f.integer("linear_key_head_dim"),
        head_v_dim=f.integer("linear_value_head_dim"), short_conv=True, conv_size=f.integer("linear_conv_kernel_dim"),
        qk_activation="silu", qk_norm="l2", use_beta=True, allow_neg_eigval=False, output_gate=True,
        gate_activation="swish", packed_qkv=True,
    )
    attention = AttentionOptions(
        d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rotary_dim=rotary,
        qk_norm=True, output_gate=True, packed_gate=True, unit_offset_norm=True, norm_eps=eps,
    )

    width = f.integer("intermediate_size") if mlp_hidden is None else mlp_hidden

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if kinds[i] == "full_attention" else FlaDeltaAttention(delta, sizes),
            n_layers=n_layers, vocab_size=f.integer("vocab_size"), d_model=hidden, mlp_hidden=width, norm_eps=eps,
            tie_embeddings=tie, chunk_size=DEFAULT_CHUNK, norm=UnitOffsetRMSNorm, mlp=mlp,
            config={"family": family, "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, f.data, "full_attention" in kinds)

    pairs = [
        *renames,
        ("model.language_model.", "model."),  # the multimodal checkpoint's text model
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.norm.", "norm."),
        (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
        (".linear_attn.", ".attn."), (".self_attn.", ".attn."),
        (".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up."), (".mlp.down_proj.", ".mlp.down."),
        (".attn.in_proj_qkv.", ".attn.qkv_proj."), (".attn.conv1d.", ".attn.qkv_conv1d."),
        (".attn.in_proj_z.", ".attn.g_proj."), (".attn.in_proj_b.", ".attn.b_proj."), (".attn.in_proj_a.", ".attn.a_proj."),
        (".attn.norm.", ".attn.o_norm."), (".attn.out_proj.", ".attn.o_proj."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    return make, Renamer(pairs)


__all__ = ["LAYER_KINDS", "LEFT_OUT", "MOE_RENAMES", "TEXT_FIELDS", "build", "read_layer_types", "read_moe"]
