"""transformers' ``lfm2`` (Lfm2ForCausalLM: LFM2 / LFM2.5) on the skeleton, as transformers 5.x computes it:

- blocks: x + mixer(operator_norm(x)), then + SwiGLU(ffn_norm(.)) with w1 = gate, w3 = up, w2 = down; the final
  norm is ``embedding_norm`` (after the last block); plain RMSNorms x / rms(x) * w
- ``conv`` layers: the gated short conv (mixer ``short_conv``, edgelin.layers.short_conv): B, C, x = in_proj(h),
  out_proj(C * conv(B * x)), a depthwise causal conv of ``conv_L_cache`` taps, no activation; its window
  ``{layer}.conv`` [B, hidden, L_cache] (transformers' cache: the last L_cache values of B * x)
- ``full_attention`` layers: softmax attention (mixer ``attention``) with per-head RMSNorms on q and k before RoPE
  (q_layernorm, k_layernorm), RoPE by halves over the whole head, grouped heads, out_proj
- the MLP width: intermediate_size, with ``block_auto_adjust_ff_dim`` int(2 I / 3), then (with a
  ``block_ffn_dim_multiplier``) int(multiplier * I) rounded up to a multiple of ``block_multiple_of``

and ``lfm2_moe`` (``load_moe``: Lfm2MoeForCausalLM, LFM2-8B-A1B and its kind): LFM2's stack (``build``) with, as
transformers 5.x computes it,

- the first ``num_dense_layers`` blocks' MLP: SwiGLU of width ``intermediate_size`` as given (no adjustment)
- every later block's MLP: a mixture of experts (edgelin.layers.moe): router logits l = gate x (no bias), scores
  sigmoid(l), the top ``num_experts_per_tok`` of sigmoid(l) + expert_bias chosen (with ``use_expert_bias``; of
  sigmoid(l) without), their weights sigmoid(l) (not the biased score) divided by (their sum + 1e-6) with
  ``norm_topk_prob``, times ``routed_scaling_factor``; each expert a SwiGLU of width ``moe_intermediate_size``
  (w1 = gate, w3 = up, w2 = down); no shared expert
- the experts' weights per expert (``feed_forward.experts.{e}.w1`` ..., what save_pretrained writes) or in
  transformers' in-memory layout (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, declare_context, read_rope
from edgelin.importers.weights import ExpertSplit, Renamer, load_checkpoint_weights
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.moe import MoE, MoEOptions
from edgelin.layers.short_conv import GatedShortConv
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # Lfm2Config's fields and defaults (transformers 5.x)
    "vocab_size": 65536, "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "norm_eps": 1e-5,
    "tie_word_embeddings": True, "conv_bias": False, "conv_L_cache": 3, "block_multiple_of": 256,
    "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True, "full_attn_idxs": None, "layer_types": None,
    "rope_parameters": None, "rope_theta": None, "rope_scaling": None,
    "block_ff_dim": None, "tie_embedding": None,  # older names transformers still reads (intermediate_size, tie_word_embeddings)
}
# Fields of LFM2's released configs that transformers' model does not read (the same model whatever they hold).
UNREAD_FIELDS = (
    "block_dim", "conv_dim", "conv_dim_out", "block_mlp_init_scale", "block_out_init_scale", "block_use_xavier_init",
    "conv_use_xavier_init", "block_use_swiglu", "block_norm_eps", "num_heads", "theta", "use_pos_enc",
)
MOE = "mixture-of-experts layers: an LFM2-MoE checkpoint says model_type lfm2_moe (Lfm2MoeForCausalLM), which edgelin reads"
REFUSED_FIELDS = {"num_experts": MOE, "num_experts_per_tok": MOE, "moe_intermediate_size": MOE, "num_dense_layers": MOE}
LAYER_KINDS = ("conv", "full_attention")


def mlp_width(f: Fields) -> int:
    width = f.integer("block_ff_dim", optional=True) or f.integer("intermediate_size")
    if f.flag("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        multiplier = f.get("block_ffn_dim_multiplier")
        if multiplier is not None:
            multiple = f.integer("block_multiple_of")
            if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not multiplier > 0:
                raise f.fail("block_ffn_dim_multiplier", f"must be a positive number or null, got {multiplier!r}")
            width = int(multiplier * width)
            width = multiple * ((width + multiple - 1) // multiple)
    if width < 1:
        raise f.fail("intermediate_size", f"gives an MLP width of {width}; it must be positive")
    return width


def read_layer_types(f: Fields, n_layers: int) -> list[str]:
    kinds = f.get("layer_types")
    if kinds is None:
        idxs = f.get("full_attn_idxs")
        idxs = list(range(n_layers)) if idxs is None else idxs  # transformers: every layer attention by default
        if not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers for i in idxs):
            raise f.fail("full_attn_idxs", f"must list layer indices in 0..{n_layers - 1}, got {str(idxs)[:80]}")
        return ["full_attention" if i in idxs else "conv" for i in range(n_layers)]
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'conv' or 'full_attention'; got {str(kinds)[:80]}")
    return kinds


def build(f: Fields, source: dict[str, Any], kinds: list[str], *, family: str, mlp_hidden: int, mlp=SwiGLU) -> tuple:
    """(a function that builds the model, the renames) from the checked config ``f`` with layer kinds ``kinds``:
    LFM2's, or a variant's that reads the same fields (LFM2-MoE's, with its ``mlp`` per layer: CausalLM's)."""
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    theta, rotary = read_rope(f, head_dim, importer=family, default_theta=1e6)
    legacy_tie = f.get("tie_embedding")
    tie = f.flag("tie_embedding") if legacy_tie is not None else f.flag("tie_word_embeddings")
    vocab, bias, taps = f.integer("vocab_size"), f.flag("conv_bias"), f.integer("conv_L_cache")
    attention = AttentionOptions(
        d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta, rotary_dim=rotary,
        qk_norm=True, norm_eps=eps,
    )

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if kinds[i] == "full_attention" else GatedShortConv(hidden, taps, bias=bias),
            n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=mlp_hidden, norm_eps=eps, tie_embeddings=tie,
            chunk_size=DEFAULT_CHUNK, config={"family": family, "chunk_size": DEFAULT_CHUNK, "source_config": source}, mlp=mlp,
        )
        return declare_context(model, source, "full_attention" in kinds)

    pairs = [
        ("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.embedding_norm.", "norm."),
        (".operator_norm.", ".attn_norm."), (".ffn_norm.", ".mlp_norm."),
        (".feed_forward.w1.", ".mlp.gate."), (".feed_forward.w3.", ".mlp.up."), (".feed_forward.w2.", ".mlp.down."),
        (".self_attn.out_proj.", ".attn.o_proj."), (".self_attn.q_layernorm.", ".attn.q_norm."),
        (".self_attn.k_layernorm.", ".attn.k_norm."), (".self_attn.", ".attn."),
        (".conv.", ".attn."),  # the conv layer's module: layers.N.conv.{in_proj, conv, out_proj}
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    return make, pairs


def load(path: str | Path) -> CausalLM:
    """An ``lfm2`` checkpoint folder (Lfm2ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    defaults = {**FIELDS, **{name: None for name in UNREAD_FIELDS}}
    f = check_fields(source, defaults=defaults, refused=REFUSED_FIELDS, importer="hf/lfm2", where=path / CONFIG_FILE)
    kinds = read_layer_types(f, f.integer("num_hidden_layers"))
    make, pairs = build(f, source, kinds, family="hf/lfm2", mlp_hidden=mlp_width(f))
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))



MOE_FIELDS: dict[str, Any] = {  # Lfm2MoeConfig's fields and defaults (transformers 5.x)
    "vocab_size": 65536, "hidden_size": 2048, "intermediate_size": 7168, "moe_intermediate_size": 1792,
    "num_hidden_layers": 32, "tie_word_embeddings": True, "rope_parameters": None, "norm_eps": 1e-5,
    "num_attention_heads": 32, "num_key_value_heads": 8, "conv_bias": False, "conv_L_cache": 3, "num_dense_layers": 2,
    "num_experts_per_tok": 4, "num_experts": 32, "use_expert_bias": True, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "layer_types": None,
    "head_dim": None,  # not a Config field, but transformers' attention reads it where a config.json has it
    "rope_theta": None, "rope_scaling": None,  # older RoPE fields transformers turns into rope_parameters
    "tie_embedding": None,  # the older name of tie_word_embeddings, which transformers still reads
    "output_router_logits": False,  # training only: the router logits returned for an auxiliary loss
}
RENORM_EPS = 1e-6  # transformers: weights / (weights.sum() + 1e-6)


def read_moe_layer_types(f: Fields, n_layers: int) -> list[str]:
    """``layer_types`` must list every layer (transformers' LFM2-MoE has no other source: full_attn_idxs is not read)."""
    kinds = f.get("layer_types")
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'conv' or 'full_attention'; got {str(kinds)[:80]}")
    return kinds


def moe_options(f: Fields, hidden: int) -> MoEOptions:
    experts, k = f.integer("num_experts"), f.integer("num_experts_per_tok")
    if k > experts:
        raise f.fail("num_experts_per_tok", f"must be at most num_experts ({experts}), got {k}")
    scale = f.get("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise f.fail("routed_scaling_factor", f"must be a number, got {scale!r}")
    f.flag("output_router_logits")
    return MoEOptions(
        d_model=hidden, num_experts=experts, top_k=k, expert_hidden=f.integer("moe_intermediate_size"), scoring="sigmoid",
        score_bias=f.flag("use_expert_bias"), renormalise=f.flag("norm_topk_prob"), renormalise_eps=RENORM_EPS,
        scaling=float(scale),
    )


def load_moe(path: str | Path) -> CausalLM:
    """An ``lfm2_moe`` checkpoint folder (Lfm2MoeForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=MOE_FIELDS, refused={}, importer="hf/lfm2_moe", where=path / CONFIG_FILE)
    n_layers, hidden = f.integer("num_hidden_layers"), f.integer("hidden_size")
    kinds = read_moe_layer_types(f, n_layers)
    dense = f.get("num_dense_layers")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise f.fail("num_dense_layers", f"must be a non-negative integer, got {dense!r}")
    options = moe_options(f, hidden)

    def mlp(i: int):
        return SwiGLU if i < dense else (lambda sizes: MoE(options))

    make, pairs = build(f, source, kinds, family="hf/lfm2_moe", mlp_hidden=f.integer("intermediate_size"), mlp=mlp)
    pairs = [  # after LFM2's (the dense MLPs'): an expert's SwiGLU under the MoE's experts, the router (``gate``), the bias
        *pairs, (".feed_forward.experts.", ".mlp.experts."), (".feed_forward.gate.", ".mlp.router."),
        (".feed_forward.expert_bias", ".mlp.expert_bias"), (".w1.", ".gate."), (".w3.", ".up."), (".w2.", ".down."),
    ]
    return load_checkpoint_weights(ckpt, make, Renamer(pairs), splits=expert_splits(options.num_experts))


def expert_splits(experts: int) -> tuple[ExpertSplit, ExpertSplit]:
    """transformers' in-memory layout of the experts, where a checkpoint holds it: ``experts.gate_up_proj`` [E, 2I, D]
    (w1 rows, then w3) and ``experts.down_proj`` [E, D, I], read as each expert's w1, w3 and w2."""
    return (ExpertSplit("experts.gate_up_proj", ("w1.weight", "w3.weight"), experts),
            ExpertSplit("experts.down_proj", ("w2.weight",), experts))


__all__ = ["FIELDS", "MOE_FIELDS", "UNREAD_FIELDS", "build", "expert_splits", "load", "load_moe", "mlp_width", "moe_options",
           "read_layer_types", "read_moe_layer_types"]
