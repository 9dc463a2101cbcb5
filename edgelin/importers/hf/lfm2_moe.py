"""transformers' ``lfm2_moe`` (Lfm2MoeForCausalLM: LFM2-8B-A1B and its kind) on the skeleton: LFM2's stack
(edgelin.importers.hf.lfm2: gated short convs, attention with q/k norms, the same norms and renames) with, as
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

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf.lfm2 import LAYER_KINDS, build
from edgelin.importers.weights import ExpertSplit, Renamer, load_checkpoint_weights
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.moe import MoE, MoEOptions
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # Lfm2MoeConfig's fields and defaults (transformers 5.x)
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


def read_layer_types(f: Fields, n_layers: int) -> list[str]:
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


def load(path: str | Path) -> CausalLM:
    """An ``lfm2_moe`` checkpoint folder (Lfm2MoeForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/lfm2_moe", where=path / CONFIG_FILE)
    n_layers, hidden = f.integer("num_hidden_layers"), f.integer("hidden_size")
    kinds = read_layer_types(f, n_layers)
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


__all__ = ["FIELDS", "expert_splits", "load", "moe_options"]
