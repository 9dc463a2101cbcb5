"""transformers' ``olmo_hybrid`` (OlmoHybridForCausalLM: OLMo-hybrid) on the skeleton, as transformers 5.x computes it:

- ``linear_attention`` layers, pre-norm: x + GDN(input_layernorm(x)), then + SwiGLU(post_attention_layernorm(.)).
  GDN is Gated DeltaNet (mixer ``fla/delta``): q_proj, k_proj, v_proj (no biases) -> one depthwise causal conv over
  [q | k | v] without bias, then SiLU (``hidden_act``); checkpoints store it as q_conv1d, k_conv1d, v_conv1d, which
  transformers concatenates at load time (and re-saves in three equal row-chunks, whatever the widths): edgelin
  concatenates them too and splits the rows by the q, k and v widths into three convs (a depthwise conv is per
  channel, so this is the same sum) -> heads (value head j reads key head j // (Nv / Nk),
  transformers' repeat_interleave) -> q, k L2-normalised (x / sqrt(sum x^2 + 1e-6)), q scaled by K^-0.5 -> the gated
  delta rule with beta = sigmoid(b_proj x), times 2 with ``linear_allow_neg_eigval``, and
  g = -exp(A_log) softplus(a_proj x + dt_bias) -> per value head RMSNorm(o) * w with eps 1e-5 (fixed in
  transformers' model, not rms_norm_eps) times silu(g_proj x) -> o_proj
- ``full_attention`` layers, post-norm: x + post_attention_layernorm(attn(x)), then + post_feedforward_layernorm(
  SwiGLU(.)); attn is softmax attention (mixer ``attention``) with RMSNorms over the whole q and k projections
  (widths H D and H_kv D) before the heads are split and RoPE applied, grouped heads, scale head_dim^-0.5, biases on
  q, k, v and o with ``attention_bias``
- RoPE by halves over the whole head with theta^(-2i / head_dim) (transformers' OlmoHybridRotaryEmbedding ignores a
  ``partial_rotary_factor``); no position encoding at all (NoPE) when ``rope_parameters`` has ``rope_theta: null``;
  theta 10000 when ``rope_parameters`` is null or absent (transformers 5.24 fills in its default); only the default
  rope_type
- the final RMSNorm ``model.norm``; plain RMSNorms x / rms(x) * w with ``rms_norm_eps``; head_dim is ``head_dim`` if
  the config has one, else hidden_size / num_attention_heads

States per layer: Gated DeltaNet "S" [B, Nv, K, V] (transformers' recurrent state, same layout) and the windows
"conv_q", "conv_k" [B, Nk K, W], "conv_v" [B, Nv V, W] (rows of transformers' one conv window [B, 2 Nk K + Nv V, W]);
attention "key", "value" [B, H_kv, P, D] (after the k norm and RoPE) and "pos".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf import attention_heads, declare_context, rope_object
from edgelin.importers.weights import Renamer, RowJoin, RowSplit, load_checkpoint_weights
from edgelin.layers import LayerSizes
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.delta import DeltaOptions, FlaDeltaAttention
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # OlmoHybridConfig's fields and defaults (transformers 5.24)
    "vocab_size": 100352, "hidden_size": 3840, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 30,
    "num_key_value_heads": None, "head_dim": None, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": None, "rope_theta": None, "attention_bias": False, "layer_types": None,
    "linear_num_key_heads": None, "linear_num_value_heads": None, "linear_key_head_dim": None, "linear_value_head_dim": None,
    "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": True,
    # accepted without effect: training only (dropout) and the initialisation of A_log and dt_bias (the checkpoint holds them)
    "attention_dropout": 0.0, "linear_a_log_min": 0.0, "linear_a_log_max": 16.0, "linear_dt_min": 0.001, "linear_dt_max": 0.1,
    "linear_dt_init_floor": 1e-4,
}
FAMILY = "hf/olmo_hybrid"
LAYER_KINDS = ("linear_attention", "full_attention")
DEFAULT_THETA = 10000.0  # transformers' default rope_theta, filled in when rope_parameters has none
O_NORM_EPS = 1e-5  # the Gated DeltaNet output norm's eps in transformers' model (OlmoHybridRMSNormGated(eps=1e-5))


def read_layer_types(f: Fields, n_layers: int) -> list[str]:
    """``layer_types``, or OlmoHybridConfig's default: full attention at i % 4 == 3 (the last layer if that gives none),
    linear attention elsewhere. Both kinds must be present (transformers refuses the config otherwise)."""
    kinds = f.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n_layers)]
        if "full_attention" not in kinds:
            kinds[-1] = "full_attention"
    if not isinstance(kinds, list) or len(kinds) != n_layers or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layer_types", f"must list {n_layers} entries, each 'linear_attention' or 'full_attention'; "
                                    f"got {str(kinds)[:80]}")
    if set(kinds) != set(LAYER_KINDS):
        raise f.fail("layer_types", "must hold at least one 'linear_attention' and one 'full_attention' layer, "
                                    "as transformers requires")
    return kinds


def read_rope(f: Fields) -> float | None:
    """rope_theta of the attention layers, or None for no position encoding (``rope_parameters`` with rope_theta null);
    the older top-level ``rope_theta`` when rope_parameters has none. Only the default rope_type."""
    params = f.get("rope_parameters")
    params = {} if params is None else params
    rope_object(f, params, importer=FAMILY, types=("default",))
    if "rope_theta" in params and params["rope_theta"] is None:
        return None  # NoPE: transformers' model builds no rotary embedding
    theta = params.get("rope_theta", f.get("rope_theta"))
    theta = DEFAULT_THETA if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise f.fail("rope_parameters", f"has rope_theta {theta!r}; it must be a positive number (or null: no RoPE)")
    return float(theta)


def delta_options(f: Fields, hidden: int, heads: int) -> DeltaOptions:
    """The Gated DeltaNet layer from the ``linear_*`` fields, with OlmoHybridConfig's defaults for the null ones."""
    k_heads = f.integer("linear_num_key_heads", optional=True) or heads
    v_heads = f.integer("linear_num_value_heads", optional=True) or heads
    if v_heads % k_heads:
        raise f.fail("linear_num_value_heads", f"must be a multiple of linear_num_key_heads ({k_heads}), got {v_heads}")
    k_dim = f.integer("linear_key_head_dim", optional=True) or int(0.75 * hidden / k_heads)
    if k_dim < 1:
        raise f.fail("linear_key_head_dim", f"is null and 0.75 hidden_size / linear_num_key_heads is "
                                            f"{0.75 * hidden / k_heads}; set it")
    v_dim = f.integer("linear_value_head_dim", optional=True) or 2 * k_dim
    return DeltaOptions(
        gated=True, num_heads=k_heads, num_v_heads=v_heads, head_k_dim=k_dim, head_v_dim=v_dim, short_conv=True,
        conv_size=f.integer("linear_conv_kernel_dim"), qk_activation="silu", qk_norm="l2", use_beta=True,
        allow_neg_eigval=f.flag("linear_allow_neg_eigval"), output_gate=True, gate_activation="swish",
    )


CONV_JOIN = RowJoin(tuple(f".linear_attn.{name}_conv1d.weight" for name in "qkv"), ".linear_attn.conv1d.weight")


def conv_split(o: DeltaOptions) -> RowSplit:
    """transformers' one conv over [q | k | v] (``linear_attn.conv1d.weight`` [2 Nk K + Nv V, 1, W]) as three convs of
    the q, k and v widths. A checkpoint stores it as q_conv1d, k_conv1d, v_conv1d, which transformers concatenates at
    load time (``CONV_JOIN``); transformers re-saves it in three row-chunks of equal size, whatever the widths."""
    key, value = o.num_heads * o.head_k_dim, o.num_v_heads * o.head_v_dim
    rows = (range(key), range(key, 2 * key), range(2 * key, 2 * key + value))
    parts = tuple((f".linear_attn.conv1d.{name}.weight", tuple(r)) for name, r in zip("qkv", rows))  # -> attn.{q,k,v}_conv1d
    return RowSplit(".linear_attn.conv1d.weight", parts)


def load(path: str | Path) -> CausalLM:
    """An ``olmo_hybrid`` checkpoint folder (OlmoHybridForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    source = ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer=FAMILY, where=ckpt.path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))  # the MLP's activation and the short conv's
    dropout = f.get("attention_dropout")  # training only
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise f.fail("attention_dropout", f"must be a number in [0, 1], got {dropout!r}")
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    heads, kv_heads, head_dim = attention_heads(f, hidden)
    kinds = read_layer_types(f, n_layers)
    theta = read_rope(f)
    bias, tie = f.flag("attention_bias"), f.flag("tie_word_embeddings")
    delta = delta_options(f, hidden, heads)
    sizes = LayerSizes(hidden_size=hidden, norm_eps=O_NORM_EPS)  # the delta layer reads norm_eps for its output norm only
    attention = AttentionOptions(
        d_model=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta or DEFAULT_THETA,
        rotary_dim=head_dim if theta is not None else 0, qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True,
        norm_eps=eps,
    )

    def make() -> CausalLM:
        model = CausalLM(
            lambda i: Attention(attention) if kinds[i] == "full_attention" else FlaDeltaAttention(delta, sizes),
            n_layers=n_layers, vocab_size=f.integer("vocab_size"), d_model=hidden, mlp_hidden=f.integer("intermediate_size"),
            norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            config={"family": FAMILY, "chunk_size": DEFAULT_CHUNK, "source_config": source},
            placement=lambda i: "post" if kinds[i] == "full_attention" else "pre",
        )
        return declare_context(model, source, True)

    # the checkpoints' names of the block norms (transformers renames them at load time: attention_layer_norm ->
    # input_layernorm, feedforward_layer_norm -> post_attention_layernorm) and the model's names, both accepted; a
    # layer's post_attention_layernorm is after the mixer in an attention layer, before the MLP in a linear one
    pairs = [("model.embed_tokens.", "embed."), ("model.layers.", "blocks."), ("model.norm.", "norm.")]
    for i, kind in enumerate(kinds):
        if kind == "full_attention":
            pairs += [(f"blocks.{i}.feedforward_layer_norm.", f"blocks.{i}.attn_post_norm."),
                      (f"blocks.{i}.post_attention_layernorm.", f"blocks.{i}.attn_post_norm."),
                      (f"blocks.{i}.post_feedforward_layernorm.", f"blocks.{i}.mlp_post_norm.")]
    pairs += [
        (".attention_layer_norm.", ".attn_norm."), (".feedforward_layer_norm.", ".mlp_norm."),
        (".input_layernorm.", ".attn_norm."), (".post_attention_layernorm.", ".mlp_norm."),
        (".linear_attn.conv1d.q.", ".attn.q_conv1d."), (".linear_attn.conv1d.k.", ".attn.k_conv1d."),
        (".linear_attn.conv1d.v.", ".attn.v_conv1d."),  # conv_split's parts
        (".linear_attn.", ".attn."), (".self_attn.", ".attn."),  # their q/k/v/a/b/g/o_proj, A_log, ...: the same names
        (".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up."), (".mlp.down_proj.", ".mlp.down."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    return load_checkpoint_weights(ckpt, make, Renamer(pairs), left_out=("mtp.",), joins=(CONV_JOIN,),
                                   splits=(conv_split(delta),))


__all__ = ["CONV_JOIN", "FIELDS", "conv_split", "delta_options", "load", "read_layer_types", "read_rope"]
