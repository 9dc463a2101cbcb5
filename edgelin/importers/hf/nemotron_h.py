"""transformers' ``nemotron_h`` (NemotronHForCausalLM: Nemotron-H, Nemotron Nano 2, Nemotron 3 with "moe" layers), on
the skeleton, as transformers 5.x computes it:

- every layer is one block x + mixer(norm(x)), its mixer one of (``layers_block_type``, or the older
  ``hybrid_override_pattern`` string "M", "*", "-"): "linear_attention" (M) edgelin.layers.mamba2's mixer, "full_attention"
  (*) softmax attention, "mlp" (-) an MLP down(relu(up(x))^2) with no state; embeddings ``embeddings``, final norm
  ``norm_f``, a head of its own (transformers never ties it); plain RMSNorms, epsilon ``layer_norm_epsilon``
- Mamba layers: ``mamba_num_heads`` heads of ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``, ``conv_kernel``; the
  step size is clamped below by ``time_step_min`` and not above (transformers' mixer reads time_step_min for the limit,
  not ``time_step_limit``); the gated norm over groups of mamba_num_heads x mamba_head_dim / n_groups features
- attention layers: grouped heads of ``head_dim``, scale head_dim^-0.5, no position encoding (transformers' NemotronH
  attention applies no RoPE), no bias, no q/k norm
- "moe" (E) layers: edgelin.layers.moe's mixture of experts as the layer's mixer (no state). The router
  (``gate``, in float32) scores sigmoid(W x); the choice adds ``e_score_correction_bias`` and, with ``n_group`` G > 1
  and ``topk_group`` < G, is made among the experts of the ``topk_group`` best of G consecutive groups (a group's
  score: the sum of its two best choice scores); ids = top ``num_experts_per_tok``; weights the unbiased scores of
  the chosen, divided by their sum + 1e-20 if ``norm_topk_prob``, times ``routed_scaling_factor``. The
  ``n_routed_experts`` experts are relu^2 MLPs without a gate (up [I, d'], down [d', I], I ``moe_intermediate_size``)
  on fc1_latent_proj(x) (d' = ``moe_latent_size``, else on x, d' = d), their weighted sum through fc2_latent_proj;
  plus one shared relu^2 MLP of width ``moe_shared_expert_intermediate_size`` on x (transformers builds exactly one,
  whatever ``n_shared_experts`` says). Experts per expert as saved, or stacked as transformers holds them
  (``experts.up_proj`` [E, I, d'], ``experts.down_proj`` [E, d', I]: ExpertSplit, no second copy)
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import declare_context, mixer_renames
from edgelin.importers.weights import ExpertSplit, Renamer, load_checkpoint_weights
from edgelin.layers.mamba2 import Mamba2Mixer, Mamba2Options
from edgelin.layers.moe import MoE, MoEMixer, MoEOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM
from edgelin.layers.mlp import MLPMixer, ReluSquaredMLP

FIELDS: dict[str, Any] = {  # NemotronHConfig's fields and defaults (transformers 5.x)
    "vocab_size": 131072, "hidden_size": 4096, "layers_block_type": None, "hybrid_override_pattern": None,
    "num_hidden_layers": None, "tie_word_embeddings": False, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 4096, "attention_bias": False, "sliding_window": None,
    "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mlp_bias": False, "ssm_state_size": 128,
    "mamba_num_heads": 128, "mamba_head_dim": 64, "mamba_hidden_act": "silu", "n_groups": 8, "conv_kernel": 4,
    "time_step_min": 0.001, "use_conv_bias": True, "use_bias": False,
    "layer_norm_epsilon": 1e-5, "num_nextn_predict_layers": 0,
    # the residual stream's dtype in a half-precision model (edgelin's is float32 anyway); the SSM cache's dtype
    "residual_in_fp32": False, "mamba_ssm_cache_dtype": "float32",
    # read by no module of transformers' model (the mixer's width is mamba_num_heads x mamba_head_dim, not expand x
    # hidden_size; its projections' bias is use_bias): initialisation, the fused kernels' limit and block size, training
    "expand": 2, "mamba_proj_bias": False, "time_step_max": 0.1, "time_step_limit": [0.0, float("inf")], "time_step_floor": 1e-4, "chunk_size": 128,
    "use_mamba_kernels": True, "initializer_range": 0.02, "rescale_prenorm_residual": True, "hidden_dropout": 0.0,
    "attention_dropout": 0.0, "num_logits_to_keep": 1,
    # in released configs (Nemotron 3 Nano's), read by no module of transformers' model: its attention applies no RoPE,
    # its norms read layer_norm_epsilon
    "rope_theta": None, "partial_rotary_factor": None, "norm_eps": None,
    # the experts: read by "moe" layers only
    "n_routed_experts": 8, "moe_intermediate_size": 7688, "moe_shared_expert_intermediate_size": 7688,
    "moe_latent_size": None, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True,
    # read by no module of transformers' model (it builds one shared expert whatever n_shared_experts says; the overlap
    # of the shared expert's computation with the routed one's is a scheduling hint), or training only (router logits)
    "n_shared_experts": 1, "moe_shared_expert_overlap": True, "output_router_logits": False,
    # the multi-token-prediction layers' kinds: read only by MTP heads (num_nextn_predict_layers, refused below)
    "mtp_layers_block_type": None,
    # the older names transformers' config still takes (read through them below)
    "mamba_n_groups": None, "mamba_d_conv": None, "mamba_expand": None, "mamba_dt_min": None, "mamba_conv_bias": None,
    "mamba_dt_max": None, "mamba_dt_limit": None, "mamba_dt_init_floor": None, "mamba_chunk_size": None,
    "mtp_hybrid_override_pattern": None,
}
OLDER_NAMES = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
               "use_conv_bias": "mamba_conv_bias"}  # name -> the older name it may have
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def layer_kinds(f: Fields) -> list[str]:
    """``layers_block_type``, else the ``hybrid_override_pattern`` string read by PATTERN."""
    kinds = f.get("layers_block_type")
    field = "layers_block_type"
    if kinds is None:
        pattern, field = f.get("hybrid_override_pattern"), "hybrid_override_pattern"
        if not isinstance(pattern, str) or not pattern or any(c not in PATTERN for c in pattern):
            raise f.fail(field, f"must be a string of {', '.join(PATTERN)} (one per layer), got {str(pattern)[:80]!r}; or set layers_block_type")
        kinds = [PATTERN[c] for c in pattern]
    if not isinstance(kinds, list) or not kinds or any(k not in PATTERN.values() for k in kinds):
        raise f.fail(field, f"must list one of {', '.join(sorted(PATTERN.values()))} per layer, got {str(kinds)[:80]}")
    n_layers = f.get("num_hidden_layers")
    if n_layers is not None and n_layers != len(kinds):
        raise f.fail("num_hidden_layers", f"is {n_layers!r} but {field} lists {len(kinds)} layers")
    return kinds


def _newer(f: Fields, name: str, kind: type | tuple[type, ...], low: float) -> tuple[str, Any]:
    """(the field read, its value): a Mamba field by its older name where the config has it (transformers' config
    then takes that one), else by its name; refused naming the field unless of ``kind`` and at least ``low``."""
    older = OLDER_NAMES.get(name)
    if older and f.get(older) is not None:
        name = older
    value = f.get(name)
    if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind) or (kind is not bool and not value >= low):
        raise f.fail(name, f"must be {'true or false' if kind is bool else f'a number >= {low:g}'}, got {value!r}")
    return name, value


def moe_options(f: Fields, hidden: int) -> MoEOptions:
    """The "moe" layers' mixture of experts (transformers' NemotronHMoE, NemotronHTopkRouter, NemotronHExperts)."""
    experts, k = f.integer("n_routed_experts"), f.integer("num_experts_per_tok")
    groups, top_groups = f.integer("n_group"), f.integer("topk_group")
    if experts % groups or experts // groups < 2:
        raise f.fail("n_group", f"must divide n_routed_experts ({experts}) into groups of at least 2 experts (transformers "
                     f"scores a group by its two best), got {groups}")
    if top_groups > groups:
        raise f.fail("topk_group", f"must be at most n_group ({groups}), got {top_groups}")
    if k > experts or (top_groups < groups and k > top_groups * (experts // groups)):
        kept = min(top_groups, groups) * experts // groups
        raise f.fail("num_experts_per_tok", f"must be at most the experts of topk_group groups ({kept}), got {k}")
    scale = f.get("routed_scaling_factor")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise f.fail("routed_scaling_factor", f"must be a number, got {scale!r}")
    f.flag("moe_shared_expert_overlap")
    f.flag("output_router_logits")
    return MoEOptions(
        d_model=hidden, num_experts=experts, top_k=k, expert_hidden=f.integer("moe_intermediate_size"), scoring="sigmoid",
        score_bias=True, renormalise=f.flag("norm_topk_prob"), renormalise_eps=1e-20, scaling=float(scale),
        shared_hidden=f.integer("moe_shared_expert_intermediate_size"), expert_kind="relu2", shared_kind="relu2",
        latent=f.integer("moe_latent_size", optional=True), groups=groups, top_groups=top_groups,
    )


def moe_renames(experts: int) -> list[tuple[str, str]]:
    """A "moe" layer's tensors -> the MoE mixer's (before ``mixer_renames``): router, its bias, latent projections,
    shared expert, and each expert's up_proj / down_proj (one pair per expert, so that no other up_proj matches)."""
    return [
        (".mixer.gate.e_score_correction_bias", ".attn.mlp.expert_bias"), (".mixer.gate.", ".attn.mlp.router."),
        (".mixer.fc1_latent_proj.", ".attn.mlp.latent_in."), (".mixer.fc2_latent_proj.", ".attn.mlp.latent_out."),
        (".mixer.shared_experts.up_proj.", ".attn.mlp.shared.up."),
        (".mixer.shared_experts.down_proj.", ".attn.mlp.shared.down."),
        (".mixer.experts.", ".attn.mlp.experts."),
        *[(f".experts.{e}.{name}_proj.", f".experts.{e}.{name}.") for e in range(experts) for name in ("up", "down")],
    ]


def expert_splits(experts: int) -> tuple[ExpertSplit, ExpertSplit]:
    """transformers' in-memory layout of the experts, where a checkpoint holds it: ``mixer.experts.up_proj`` [E, I, d']
    and ``mixer.experts.down_proj`` [E, d', I], read as each expert's up_proj and down_proj."""
    return (ExpertSplit("mixer.experts.up_proj", ("up_proj.weight",), experts),
            ExpertSplit("mixer.experts.down_proj", ("down_proj.weight",), experts))


def load(path: str | Path) -> CausalLM:
    """A ``nemotron_h`` checkpoint folder."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/nemotron_h", where=path / CONFIG_FILE)
    kinds = layer_kinds(f)
    f.choice("mlp_hidden_act", ("relu2",))
    f.choice("mamba_hidden_act", ("silu",))
    for name in ("attention_bias", "mlp_bias"):
        if f.flag(name):
            raise f.fail(name, "is true; edgelin's nemotron_h importer supports false only")
    if f.get("sliding_window") is not None:
        raise f.fail("sliding_window", "is set; edgelin's nemotron_h importer supports null (attention over the whole context)")
    if f.get("num_nextn_predict_layers") not in (0, None):
        raise f.fail("num_nextn_predict_layers", "is not 0; edgelin does not export multi-token-prediction layers")
    f.flag("residual_in_fp32")
    hidden, eps = f.integer("hidden_size"), f.number("layer_norm_epsilon")
    heads, kv_heads, head_dim = f.integer("num_attention_heads"), f.integer("num_key_value_heads"), f.integer("head_dim")
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
    m_heads, (groups_field, groups) = f.integer("mamba_num_heads"), _newer(f, "n_groups", int, 1)
    if m_heads % groups:
        raise f.fail(groups_field, f"must divide mamba_num_heads ({m_heads}), got {groups}")
    mamba = Mamba2Options(
        d_model=hidden, num_heads=m_heads, head_dim=f.integer("mamba_head_dim"), state_size=f.integer("ssm_state_size"),
        n_groups=groups, conv_kernel=_newer(f, "conv_kernel", int, 1)[1], conv_bias=_newer(f, "use_conv_bias", bool, 0)[1],
        bias=f.flag("use_bias"), norm_eps=eps, dt_min=float(_newer(f, "time_step_min", (int, float), 0)[1]), dt_max=float("inf"),
    )
    attention = AttentionOptions(d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=0, norm_eps=eps)
    mlp = SimpleNamespace(d_model=hidden, mlp_hidden=f.integer("intermediate_size"))
    vocab = f.integer("vocab_size")
    f.flag("tie_word_embeddings")  # transformers' NemotronH keeps lm_head its own whatever this says
    moe = moe_options(f, hidden) if "moe" in kinds else None

    def mixer(i: int):
        if kinds[i] == "full_attention":
            return Attention(attention)
        if kinds[i] == "moe":
            return MoEMixer(MoE(moe))
        return Mamba2Mixer(mamba) if kinds[i] == "linear_attention" else MLPMixer(ReluSquaredMLP(mlp))

    def make() -> CausalLM:
        model = CausalLM(
            mixer, n_layers=len(kinds), vocab_size=vocab, d_model=hidden, mlp_hidden=None, norm_eps=eps,
            tie_embeddings=False, chunk_size=DEFAULT_CHUNK,
            config={"family": "hf/nemotron_h", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, source, "full_attention" in kinds)

    pairs = [  # transformers saves "backbone." (the released checkpoints' names) and loads "model." too; "backbone."
        # last, so that a missing tensor is named as saved
        ("model.embeddings.", "embed."), ("backbone.embeddings.", "embed."), ("model.layers.", "blocks."),
        ("backbone.layers.", "blocks."), ("model.norm_f.", "norm."), ("backbone.norm_f.", "norm."),
        (".mixer.up_proj.", ".attn.mlp.up."), (".mixer.down_proj.", ".attn.mlp.down."),
        *(moe_renames(moe.num_experts) if moe else []), *mixer_renames("mixer"), (".norm.", ".attn_norm."),
    ]
    splits = expert_splits(moe.num_experts) if moe else ()
    return load_checkpoint_weights(ckpt, make, Renamer(pairs), splits=splits)


__all__ = ["FIELDS", "expert_splits", "layer_kinds", "load", "moe_options", "moe_renames"]
