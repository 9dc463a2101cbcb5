"""transformers' ``granitemoehybrid`` (GraniteMoeHybridForCausalLM: Granite-4.0-H), dense or with experts, on the
skeleton, as transformers 5.x computes it:

- embeddings times ``embedding_multiplier``; blocks: x + r * mixer(input_layernorm(x)), then
  + r * shared_mlp(post_attention_layernorm(.)) with r = ``residual_multiplier``; the MLP is ``shared_mlp``
  (input_linear: gate rows then up rows; output_linear); final norm ``norm``; logits / ``logits_scaling``
- ``mamba`` layers (``layer_types`` "mamba" / "linear_attention"): edgelin.layers.mamba2's mixer, as Bamba's
- ``attention`` layers: grouped heads, softmax scale ``attention_multiplier`` (not head_dim^-0.5), RoPE by halves
  over the whole head only with ``position_embedding_type: "rope"`` (none otherwise: Granite-4.0-H's attention
  layers carry no position encoding), no q/k norm
- experts (``num_local_experts`` E > 0, every layer): the MLP is edgelin.layers.moe's, ``shared_mlp`` its shared expert
  (always on, no gate) beside ``block_sparse_moe``: router logits l = W x, ids = top ``num_experts_per_tok`` of l,
  weights softmax(l[ids]) (scoring "topk_softmax"), E SwiGLU experts of width ``intermediate_size`` stored stacked
  (``input_linear`` [E, 2I, d]: gate rows then up rows; ``output_linear`` [E, d, I]; or transformers' in-memory
  ``experts.gate_up_proj`` / ``experts.down_proj``), read per expert without a second copy (ExpertSplit)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, declare_context, mamba_options, mixer_renames, read_rope
from edgelin.importers.weights import ExpertSplit, Renamer, load_checkpoint_weights
from edgelin.layers.mamba2 import Mamba2Mixer
from edgelin.layers.moe import MoE, MoEOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM
from edgelin.layers.mlp import PackedSwiGLU

FIELDS: dict[str, Any] = {  # GraniteMoeHybridConfig's fields and defaults (transformers 5.x)
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
    "tie_word_embeddings": False, "embedding_multiplier": 1.0, "logits_scaling": 1.0, "residual_multiplier": 1.0,
    "attention_multiplier": 1.0, "num_local_experts": 8, "shared_intermediate_size": 1024, "position_embedding_type": None,
    "layer_types": None, "rope_parameters": None, "rope_theta": None,
    "mamba_n_heads": 128, "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4,
    "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False, "time_step_limit": [0.0, float("inf")],
    # the experts' width and routing: read with experts (num_local_experts > 0) only
    "intermediate_size": 11008, "num_experts_per_tok": 2,
    # no effect at inference (the router's auxiliary loss and its logits as outputs: training)
    "router_aux_loss_coef": 0.001, "output_router_logits": False, "mamba_chunk_size": 256, "attention_dropout": 0.0,
    "num_logits_to_keep": 1, "z_loss_coefficient": 0.0,
    # in released configs (IBM's converter writes them): the older RoPE field (read by read_rope, as rope_parameters),
    # and the norm's name, which transformers' model does not read (its norms are RMSNorms whatever it says)
    "rope_scaling": None, "normalization_function": "rmsnorm",
}
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention"}


def load(path: str | Path) -> CausalLM:
    """A ``granitemoehybrid`` checkpoint folder, dense (num_local_experts 0) or with experts."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/granitemoehybrid", where=path / CONFIG_FILE)
    experts = f.get("num_local_experts")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise f.fail("num_local_experts", f"must be 0 (dense MLPs) or a positive number of experts, got {experts!r}")
    f.choice("hidden_act", ("silu",))
    if f.flag("attention_bias"):
        raise f.fail("attention_bias", "is true; edgelin's granitemoehybrid importer supports false only")
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    kinds = f.get("layer_types")
    kinds = ["mamba"] * n_layers if kinds is None else kinds
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'mamba' or 'attention'; got {str(kinds)[:80]}")
    kinds = [LAYER_KINDS[k] for k in kinds]
    position = f.get("position_embedding_type")
    if position not in (None, "rope", "nope"):
        raise f.fail("position_embedding_type", f"is {position!r}; edgelin supports 'rope', 'nope' and null (no position encoding)")
    theta, rotary = read_rope(f, head_dim, importer="hf/granitemoehybrid", default_theta=10000.0)
    attention = AttentionOptions(
        d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
        rotary_dim=rotary if position == "rope" else 0, scale=f.number("attention_multiplier"), norm_eps=eps,
    )
    mamba = mamba_options(f, hidden)
    tie, vocab, mlp = f.flag("tie_word_embeddings"), f.integer("vocab_size"), f.integer("shared_intermediate_size")
    scales = dict(embed_scale=f.number("embedding_multiplier"), residual_scale=f.number("residual_multiplier"),
                  logits_scale=f.number("logits_scaling"))

    moe = moe_options(f, hidden, experts, mlp) if experts else None

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if kinds[i] == "attention" else Mamba2Mixer(mamba), n_layers=n_layers,
            vocab_size=vocab, d_model=hidden, mlp_hidden=mlp, norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            mlp=PackedSwiGLU if moe is None else (lambda i: lambda sizes: MoE(moe)), **scales,
            config={"family": "hf/granitemoehybrid", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, source, "attention" in kinds)

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.norm.", "norm."),
        (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
        (".shared_mlp.", ".mlp." if moe is None else ".mlp.shared."), *mixer_renames("mamba"), (".self_attn.", ".attn."),
    ]
    if moe is not None:
        pairs += MOE_RENAMES
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    splits = () if moe is None else expert_splits(experts)
    return load_checkpoint_weights(ckpt, make, Renamer(pairs), splits=splits)


MOE_RENAMES = [  # the router as saved (``router.layer``) and as transformers holds it; the experts' modules (expert_splits)
    (".block_sparse_moe.router.layer.", ".mlp.router."), (".block_sparse_moe.router.", ".mlp.router."),
    (".block_sparse_moe.input_linear.", ".mlp.experts."), (".block_sparse_moe.output_linear.", ".mlp.experts."),
    (".block_sparse_moe.experts.", ".mlp.experts."),
]


def moe_options(f: Fields, hidden: int, experts: int, shared: int) -> MoEOptions:
    """The mixture of experts of every layer (transformers' GraniteMoeHybridMoE and the layer's ``shared_mlp``)."""
    k = f.get("num_experts_per_tok")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= experts:
        raise f.fail("num_experts_per_tok", f"must be an integer from 1 to num_local_experts ({experts}), got {k!r}")
    f.flag("output_router_logits")
    return MoEOptions(d_model=hidden, num_experts=experts, top_k=k, expert_hidden=f.integer("intermediate_size"),
                      scoring="topk_softmax", shared_hidden=shared, shared_kind="packed_swiglu")


def expert_splits(experts: int) -> tuple[ExpertSplit, ...]:
    """The stacked experts, as saved (``block_sparse_moe.input_linear.weight`` [E, 2I, d], gate rows then up rows;
    ``output_linear.weight`` [E, d, I]) and as transformers holds them (``experts.gate_up_proj``, ``experts.down_proj``),
    read as each expert's gate, up and down."""
    return (ExpertSplit("block_sparse_moe.input_linear.weight", ("gate.weight", "up.weight"), experts),
            ExpertSplit("block_sparse_moe.output_linear.weight", ("down.weight",), experts),
            ExpertSplit("block_sparse_moe.experts.gate_up_proj", ("gate.weight", "up.weight"), experts),
            ExpertSplit("block_sparse_moe.experts.down_proj", ("down.weight",), experts))


__all__ = ["FIELDS", "MOE_RENAMES", "expert_splits", "load", "moe_options"]
