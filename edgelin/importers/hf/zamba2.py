"""transformers' ``zamba2`` (Zamba2ForCausalLM: Zamba2-1.2B, 2.7B, 7B) on the skeleton, as transformers 5.x computes it:

- Mamba2 layers (``layers_block_type`` "mamba" / "linear_attention"): x + mamba(input_layernorm(x)), no MLP; the mixer is
  edgelin.layers.mamba2's with ``n_mamba_heads`` heads of ``mamba_expand`` x hidden / heads, ``mamba_ngroups`` groups,
  a conv with a bias whatever ``use_conv_bias`` says (transformers builds it with one), biases on in_proj / out_proj
  by ``add_bias_linear``, dt clamped below at ``time_step_min`` (transformers' time_step_limit (time_step_min, inf)),
  the gated norm's epsilon 1e-5 (fixed in transformers)
- hybrid layers ("hybrid"): edgelin.layers.shared_block's mixer (kind "zamba2/hybrid", Block placement "none"):
  ``num_mem_blocks`` shared blocks used in turn by the hybrid layers (hybrid layer j uses block j mod num_mem_blocks),
  each stored once; per use its adapters of rank ``adapter_rank`` (on gate_up always, on q, k, v with
  ``use_shared_attention_adapter``), its ``linear`` and its Mamba2 layer; attention heads 2 hidden / heads wide, scale
  (head_dim / 2)^-0.5, RoPE by halves over the whole head with ``use_mem_rope``
- embeddings -> layers -> final_layernorm -> lm_head (tied by default); plain RMSNorms with ``rms_norm_eps``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import check_fields
from edgelin.importers.hf import declare_context, read_rope
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.mamba2 import Mamba2Mixer, Mamba2Options
from edgelin.layers.shared_block import ACTIVATIONS, SharedBlock, SharedBlockOptions, Zamba2Hybrid
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

# transformers' default layers_block_type (Zamba2-2.7B's 54 layers)
DEFAULT_LAYERS = (["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 + ["hybrid"]
                  + ["mamba"] * 2)
LAYER_KINDS = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
LONG_CONTEXT = 16384  # transformers' max_position_embeddings under use_long_context (it changes nothing else)
GATED_NORM_EPS = 1e-5  # transformers' Zamba2MambaMixer's gated RMSNorm, whatever rms_norm_eps says

FIELDS: dict[str, Any] = {  # Zamba2Config's fields and defaults (transformers 5.x)
    "vocab_size": 32000, "hidden_size": 2560, "num_hidden_layers": 54, "layers_block_type": None,
    "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1, "n_mamba_heads": 8, "time_step_min": 0.001,
    "add_bias_linear": False, "intermediate_size": None, "hidden_act": "gelu", "num_attention_heads": 32,
    "num_key_value_heads": None, "num_mem_blocks": 1, "use_shared_attention_adapter": False, "adapter_rank": 128,
    "use_mem_rope": False, "rope_parameters": None, "rope_theta": None, "rms_norm_eps": 1e-5, "use_long_context": False,
    "tie_word_embeddings": True,
    # transformers' conv always has a bias; the rest: initialisation, kernel choices, training, generation
    "use_conv_bias": True, "time_step_max": 0.1, "time_step_floor": 1e-4, "use_mamba_kernels": True, "chunk_size": 256,
    "use_mem_eff_path": False, "attention_dropout": 0.0, "num_logits_to_keep": 1,
    # derived by transformers' config from the fields above whatever the file says (saved by save_pretrained)
    "attention_hidden_size": None, "attention_head_dim": None, "head_dim": None, "mamba_headdim": None, "kv_channels": None,
    "num_query_groups": None, "hybrid_layer_ids": None,
}


def load(path: str | Path) -> CausalLM:
    """A ``zamba2`` checkpoint folder (Zamba2ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/zamba2", where=path / CONFIG_FILE)
    activation = f.choice("hidden_act", ACTIVATIONS)
    hidden, n_layers, eps = f.integer("hidden_size"), f.integer("num_hidden_layers"), f.number("rms_norm_eps")
    kinds = f.get("layers_block_type")
    kinds = DEFAULT_LAYERS if kinds is None else kinds
    if not isinstance(kinds, list) or any(k not in LAYER_KINDS for k in kinds):
        raise f.fail("layers_block_type", f"must list 'mamba' (or 'linear_attention') and 'hybrid' layers; got {str(kinds)[:80]}")
    if len(kinds) != n_layers:
        raise f.fail("num_hidden_layers", f"is {n_layers} but layers_block_type lists {len(kinds)} layers; make them agree")
    hybrid = [i for i, k in enumerate(kinds) if LAYER_KINDS[k] == "hybrid"]

    heads, expand = f.integer("n_mamba_heads"), f.integer("mamba_expand")
    if (expand * hidden) % heads:
        raise f.fail("n_mamba_heads", f"must divide mamba_expand x hidden_size ({expand} x {hidden})")
    groups = f.integer("mamba_ngroups")
    if heads % groups:
        raise f.fail("mamba_ngroups", f"must divide n_mamba_heads ({heads}), got {groups}")
    bias, low = f.flag("add_bias_linear"), f.get("time_step_min")
    if isinstance(low, bool) or not isinstance(low, (int, float)) or not low >= 0:
        raise f.fail("time_step_min", f"must be a number >= 0 (the lower clamp of dt), got {low!r}")
    mamba = Mamba2Options(
        d_model=hidden, num_heads=heads, head_dim=expand * hidden // heads, state_size=f.integer("mamba_d_state"),
        n_groups=groups, conv_kernel=f.integer("mamba_d_conv"), conv_bias=True, bias=bias, norm_eps=GATED_NORM_EPS,
        dt_min=float(low),
    )

    attn_heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", optional=True) or attn_heads
    if (2 * hidden) % attn_heads:
        raise f.fail("num_attention_heads", f"must divide 2 x hidden_size ({2 * hidden}): the shared attention's heads are "
                     "2 hidden / heads wide")
    if attn_heads % kv_heads:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads ({attn_heads}), got {kv_heads}")
    adapters = f.flag("use_shared_attention_adapter")
    if adapters and kv_heads != attn_heads:
        raise f.unsupported("use_shared_attention_adapter", f"is true with num_key_value_heads {kv_heads} < num_attention_heads "
                            f"{attn_heads}; transformers' adapters are 2 x hidden_size wide and fit k and v only without "
                            "grouped heads")
    rope = f.flag("use_mem_rope")
    # the whole head rotates: transformers' default RoPE ignores partial_rotary_factor
    theta, _ = read_rope(f, 2 * hidden // attn_heads, importer="hf/zamba2", default_theta=10000.0)
    n_blocks = f.integer("num_mem_blocks")
    shared = SharedBlockOptions(
        d_model=hidden, num_heads=attn_heads, num_kv_heads=kv_heads,
        mlp_hidden=f.integer("intermediate_size", optional=True) or 4 * hidden,
        norm_eps=eps, rope_theta=theta, rope=rope, activation=activation, mlp_bias=bias, adapter_rank=f.integer("adapter_rank"),
        attention_adapters=adapters,
    )
    tie, vocab = f.flag("tie_word_embeddings"), f.integer("vocab_size")
    # transformers ties the hybrid layers' shared_transformer copies only with tied embeddings (it drops its whole tie
    # mapping otherwise): untied, every hybrid layer has a block of its own, as transformers runs it
    block = [j % n_blocks if tie else j for j in range(len(hybrid))]
    context = {**source, "max_position_embeddings": LONG_CONTEXT} if f.flag("use_long_context") else source

    def make() -> CausalLM:
        blocks: dict[int, SharedBlock] = {}  # shared block -> its module, built at its first use

        def mixer(i: int):
            if i not in hybrid:
                return Mamba2Mixer(mamba)
            b = block[hybrid.index(i)]
            owner = b not in blocks
            if owner:
                blocks[b] = SharedBlock(shared)
            return Zamba2Hybrid(blocks[b], mamba, owner=owner)

        model = CausalLM(
            mixer, n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=None, norm_eps=eps, tie_embeddings=tie,
            chunk_size=DEFAULT_CHUNK, placement=lambda i: "none" if i in hybrid else "pre",
            config={"family": "hf/zamba2", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )
        return declare_context(model, context, bool(hybrid))

    lists = [("feed_forward.gate_up_proj_adapter_list", "mlp_adapter")]
    if adapters:
        lists += [(f"self_attn.linear_{x}_adapter_list", f"{x}_adapter") for x in "qkv"]
    # untied, hybrid layer j's copy holds the adapters of every layer of its cycle; transformers uses the j-th only
    unused = tuple(f"model.layers.{h}.shared_transformer.{name}.{i}." for j, h in enumerate(hybrid) for name, _ in lists
                   for i in range(len(hybrid)) if i != j and i % n_blocks == j % n_blocks and block[i] != block[j])
    pairs = renames(n_layers, hybrid, block, lists, tie)
    return load_checkpoint_weights(ckpt, make, Renamer(pairs), left_out=unused)


def renames(n_layers: int, hybrid: list[int], block: list[int], lists: list[tuple[str, str]], tie: bool) -> list[tuple[str, str]]:
    """Checkpoint -> model names. Hybrid layer j uses shared block ``block[j]``: every hybrid layer's
    ``shared_transformer`` copy (transformers saves the first use of each block; a checkpoint may hold the tied copies
    too) is read as its block's, held by the block's first use; adapter j of a block's adapter ``lists`` (transformers'
    per-block lists, indexed by hybrid layer) is hybrid layer j's own."""
    owner: dict[int, int] = {}
    for j, h in enumerate(hybrid):
        owner.setdefault(block[j], h)
    pairs = [(f"model.layers.{h}.shared_transformer.", f"shared.{block[j]}.") for j, h in enumerate(hybrid)]
    for j, h in enumerate(hybrid):
        pairs += [(f"shared.{block[j]}.{old}.{j}.{k}.weight", f"blocks.{h}.attn.{new}.{k}.weight")
                  for old, new in lists for k in (0, 1)]
    pairs += [(f"shared.{b}.", f"blocks.{h}.attn.shared.") for b, h in owner.items()]
    for i in range(n_layers):
        at = f"model.layers.{i}."
        if i in hybrid:
            pairs += [(at + "linear.", f"blocks.{i}.attn.linear."),
                      (at + "mamba_decoder.input_layernorm.", f"blocks.{i}.attn.input_layernorm."),
                      (at + "mamba_decoder.mamba.norm.", f"blocks.{i}.attn.mamba.gate_norm_"),
                      (at + "mamba_decoder.mamba.", f"blocks.{i}.attn.mamba.")]
        else:
            pairs += [(at + "input_layernorm.", f"blocks.{i}.attn_norm."), (at + "mamba.norm.", f"blocks.{i}.attn.gate_norm_"),
                      (at + "mamba.", f"blocks.{i}.attn.")]
    pairs += [("model.embed_tokens.", "embed."), ("model.final_layernorm.", "norm.")]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    return pairs


__all__ = ["FIELDS", "load", "renames"]
