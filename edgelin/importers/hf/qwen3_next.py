"""transformers' ``qwen3_next`` (Qwen3NextForCausalLM), dense or with mixture-of-experts MLPs, on the skeleton.

Qwen3-Next is the model Qwen3.5's text stack came from: the same blocks (zero-centred RMSNorms, Gated DeltaNet
layers with grouped value heads and a gated output norm, gated softmax attention with partial RoPE; see
``edgelin.importers.hf.qwen3_5``), and the same model once its weights are unpacked. What differs is the
checkpoint's layout: each Gated DeltaNet layer projects with two fused matrices whose rows are grouped by key head,

- ``in_proj_qkvz``: for each key head g, [q_g (K) | k_g (K) | v of its r = Nv / Nk value heads (r V) | z of them (r V)]
- ``in_proj_ba``:   for each key head g, [b of its r value heads | a of them]

which edgelin reads as Qwen3.5's ``in_proj_qkv`` ([all q | all k | all v]), ``in_proj_z``, ``in_proj_b`` and
``in_proj_a`` (a row permutation at load time: the graphs are Qwen3.5's, nothing is reshuffled per token).

A layer's MLP is a mixture of experts (edgelin.layers.moe, the rules in qwen_hybrid's ``read_moe``: softmax router,
top ``num_experts_per_tok``, a gated shared expert) when ``num_experts`` > 0, its index i is not in ``mlp_only_layers``
and (i + 1) is a multiple of ``decoder_sparse_step`` (transformers' rule, Qwen3NextDecoderLayer); every other layer's
MLP is a dense SwiGLU of width ``intermediate_size``. The chosen scores are divided by their sum when
``norm_topk_prob`` (the default; no epsilon, no scaling), kept as softmax probabilities otherwise. Without a sparse
layer the expert fields are not read. Released checkpoints store the experts per expert (``mlp.experts.{e}.gate_proj``
...); the stacked layout transformers holds in memory is read too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf.qwen_hybrid import LEFT_OUT, MOE_RENAMES, TEXT_FIELDS, build, read_moe
from edgelin.importers.weights import RowSplit, load_checkpoint_weights
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.moe import MoE
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # Qwen3NextConfig's fields and defaults (transformers 5.x); the rest as Qwen3.5's
    **TEXT_FIELDS,
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    # the experts: which layers have them, and their sizes and routing (not read without a sparse layer)
    "num_experts": 512, "decoder_sparse_step": 1, "mlp_only_layers": None, "num_experts_per_tok": 10,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
    "output_router_logits": False,  # training only: the router logits returned for an auxiliary loss
    "router_aux_loss_coef": 0.001,  # training only: that loss's weight
}
FAMILY = "hf/qwen3_next"


def moe_layers(f: Fields, n_layers: int) -> list[int]:
    """The layers transformers builds as mixture-of-experts blocks (Qwen3NextDecoderLayer's rule)."""
    experts = f.get("num_experts")
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        raise f.fail("num_experts", f"must be a non-negative integer, got {experts!r}")
    dense = f.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
        raise f.fail("mlp_only_layers", f"must be a list of layer indices, got {str(dense)[:80]}")
    step = f.integer("decoder_sparse_step")
    return [i for i in range(n_layers) if experts > 0 and i not in dense and (i + 1) % step == 0]


def group_rows(n_groups: int, widths: tuple[int, ...]) -> list[list[list[int]]]:
    """rows[p][g]: the row indices of piece p of group g in a matrix laid out group by group, each group
    [piece 0 | piece 1 | ...] of ``widths``."""
    stride, rows = sum(widths), []
    for p, width in enumerate(widths):
        start = sum(widths[:p])
        rows.append([list(range(g * stride + start, g * stride + start + width)) for g in range(n_groups)])
    return rows


def fused_splits(f: Fields) -> tuple[RowSplit, RowSplit]:
    """in_proj_qkvz -> in_proj_qkv + in_proj_z and in_proj_ba -> in_proj_b + in_proj_a, from the head counts."""
    nk, nv = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    kd, vd = f.integer("linear_key_head_dim"), f.integer("linear_value_head_dim")
    if nv % nk:
        raise f.fail("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({nk}), got {nv}")
    r = nv // nk
    q, k, v, z = group_rows(nk, (kd, kd, r * vd, r * vd))
    b, a = group_rows(nk, (r, r))
    flat = lambda groups: tuple(i for rows in groups for i in rows)  # noqa: E731 -- group after group
    qkvz = RowSplit(".in_proj_qkvz.weight", ((".in_proj_qkv.weight", flat(q) + flat(k) + flat(v)), (".in_proj_z.weight", flat(z))))
    ba = RowSplit(".in_proj_ba.weight", ((".in_proj_b.weight", flat(b)), (".in_proj_a.weight", flat(a))))
    return qkvz, ba


def load(path: str | Path) -> CausalLM:
    """A ``qwen3_next`` checkpoint folder (Qwen3NextForCausalLM): dense MLPs, or mixture-of-experts ones where
    ``moe_layers`` says."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    source = ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer=FAMILY, where=ckpt.path / CONFIG_FILE)
    sparse = set(moe_layers(f, f.integer("num_hidden_layers")))
    options, experts = {}, ()
    if sparse:
        moe, experts = read_moe(f, renormalise=f.flag("norm_topk_prob"))
        options = {"mlp": lambda i: (lambda sizes: MoE(moe)) if i in sparse else SwiGLU, "renames": MOE_RENAMES}
    make, rename = build(f, source=source, family=FAMILY, **options)
    return load_checkpoint_weights(ckpt, make, rename, left_out=LEFT_OUT, splits=fused_splits(f) + experts)


__all__ = ["FIELDS", "fused_splits", "group_rows", "load", "moe_layers"]
