"""flash-linear-attention (fla) checkpoints, imported onto edgelin's one model skeleton (edgelin.skeleton).

fla saves its models HF-style: ``config.json`` (with ``model_type``) + ``model.safetensors``. Every fla causal
LM has edgelin's skeleton,

    embeddings -> n x [RMSNorm -> token mixer -> + -> RMSNorm -> SwiGLU MLP -> +] -> RMSNorm -> lm_head

and differs in its token mixer. A family (one module per ``model_type``: ``linear_attn``, ``retnet``, ``gla``)
is a ``Family``: the config fields it knows, its mixer builder and its weight renames; ``load_fla`` reads the
shared fields (edgelin.importers.fields), builds ``edgelin.skeleton.CausalLM`` with the family's mixers and fla's
softmax ``Attention`` at the layers of the ``attn`` field (a hybrid, edgelin.layers.attention), and loads the weights.

Conventions of fla carried over exactly are listed in each family's module and in docs/importers.md.
fla's ``attn`` field (GLA's and RetNet's configs): ``layers``, ``num_heads``, ``num_kv_heads`` (default num_heads),
``qkv_bias`` (False), ``window_size`` (None: the whole context; else each query sees itself and the W - 1 positions
before it, and the cache keeps the last W), ``rope_theta`` (10000); head_dim = hidden_size / num_heads; RoPE by
halves over the whole head at absolute positions, keys cached after RoPE; no output gate, no q/k norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from torch import nn

from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

# Fields shared by fla's causal LMs, with fla's defaults. The fuse_* options and use_l2warp select kernels or a
# training loss: the same math at inference (fuse_norm fuses the residual add into the RMSNorm, fuse_swiglu the
# SwiGLU into the down projection), so they are accepted whatever their value.
COMMON_FIELDS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 24, "norm_eps": 1e-6,
    "hidden_ratio": 4, "intermediate_size": None, "hidden_act": "swish", "tie_word_embeddings": False,
    "fuse_norm": True, "fuse_swiglu": True, "fuse_cross_entropy": True, "fuse_linear_cross_entropy": False,
    "use_l2warp": False,
    "attn": None,  # hybrids: fla's softmax Attention at attn["layers"] (read_attn)
}

# Options edgelin does not implement: refused unless unset, with what they are.
REFUSED_FIELDS: dict[str, str] = {
    "attnres_block_size": "attention residuals across blocks",
}


@dataclass(frozen=True)
class Common:
    """The skeleton's sizes, read from the fields every fla causal LM shares."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    norm_eps: float
    mlp_hidden: int
    tie_embeddings: bool

    @classmethod
    def read(cls, f: Fields) -> "Common":
        f.choice("hidden_act", ("swish",))
        for name in ("fuse_norm", "fuse_swiglu", "fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp"):
            f.flag(name)
        return cls.sizes(f, share=2 / 3, multiple=256)  # fla's GatedMLP: 2/3 of hidden_ratio, up to a multiple of 256

    @classmethod
    def sizes(cls, f: Fields, *, share: float, multiple: int) -> "Common":
        """The sizes; the MLP's width ``intermediate_size``, or fla's from ``hidden_ratio`` (4 when null):
        int(hidden * ratio * share) rounded up to a multiple of ``multiple``."""
        hidden = f.integer("hidden_size")
        mlp = f.integer("intermediate_size", optional=True)
        if mlp is None:
            ratio = f.get("hidden_ratio")
            ratio = 4 if ratio is None else ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0:
                raise f.fail("hidden_ratio", f"must be a positive number or null, got {ratio!r}")
            mlp = multiple * ((int(hidden * ratio * share) + multiple - 1) // multiple)
        return cls(
            vocab_size=f.integer("vocab_size"), hidden_size=hidden, num_layers=f.integer("num_hidden_layers"),
            norm_eps=f.number("norm_eps"), mlp_hidden=mlp, tie_embeddings=f.flag("tie_word_embeddings"),
        )


@dataclass(frozen=True)
class Family:
    """One fla model type: its own config fields (with fla's defaults), how to build one mixer from them, and the
    renames from fla's tensor names to the layer's (fragments, see ``Renamer``). Each family lives in its own
    module of this package and registers its ``load`` in ``edgelin.importers.IMPORTERS``."""

    name: str  # e.g. "fla/linear_attn"
    fields: dict[str, Any]
    read: Callable[[Fields, Common], Any]  # -> the layer options
    make_layer: Callable[[Any, Common], nn.Module]
    renames: Callable[[Any], list[tuple[str, str]]] = field(default=lambda options: [])
    chunk_size: int = DEFAULT_CHUNK  # the prefill chunk it exports with (per-feature decays want a smaller one)
    read_common: Callable[[Fields], Common] = Common.read  # the shared sizes (a family with its own MLP reads its own)
    # extra arguments of the skeleton (edgelin.skeleton.CausalLM: norm, mlp, embed_norm) from the options
    skeleton: Callable[[Any, Common], dict[str, Any]] = field(default=lambda options, common: {})
    indexed: bool = False  # make_layer takes the layer index as a third argument


ATTN_KEYS = {"layers": None, "num_heads": None, "num_kv_heads": None, "qkv_bias": False, "window_size": None, "rope_theta": 10000.0}


def read_attn(f: Fields, common: Common) -> dict[int, AttentionOptions]:
    """fla's ``attn`` field (one spec, or a list of specs for different layers): layer -> its attention options."""
    attn = f.get("attn")
    if attn is None:
        return {}
    specs = [attn] if isinstance(attn, dict) else attn
    if not isinstance(specs, list) or not specs or not all(isinstance(s, dict) for s in specs):
        raise f.fail("attn", f"must be an object, a list of objects or null, got {str(attn)[:60]}")
    out: dict[int, AttentionOptions] = {}
    for spec in specs:
        out.update(read_attn_spec(f, common, spec, taken=set(out)))
    return out


def read_attn_spec(f: Fields, common: Common, spec: dict[str, Any], taken: set[int]) -> dict[int, AttentionOptions]:
    unknown = sorted(set(spec) - set(ATTN_KEYS))
    if unknown:
        raise f.fail("attn", f"has the key {unknown[0]!r}, unknown to edgelin's fla importer; it may change the model")
    layers = spec.get("layers")
    if not isinstance(layers, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise f.fail("attn", f"needs 'layers', a list of layer indices, got {layers!r}")
    if any(not 0 <= i < common.num_layers for i in layers) or len(set(layers)) != len(layers) or set(layers) & taken:
        raise f.fail("attn", f"lists layers {list(layers)}; each must be one of 0..{common.num_layers - 1}, once")
    sub = Fields(spec, ATTN_KEYS, f.where)
    heads = sub.integer("num_heads")
    kv_heads = sub.integer("num_kv_heads", optional=True) or heads
    if common.hidden_size % heads:
        raise f.fail("attn", f"has num_heads {heads}, which does not divide hidden_size ({common.hidden_size})")
    if heads % kv_heads:
        raise f.fail("attn", f"has num_kv_heads {kv_heads}, which does not divide num_heads ({heads})")
    head_dim = common.hidden_size // heads
    if head_dim % 2:
        raise f.fail("attn", f"gives a head width of {head_dim}; RoPE needs an even width")
    window = sub.integer("window_size", optional=True)
    limit = f.data.get("max_position_embeddings")
    if window is not None and isinstance(limit, int) and not isinstance(limit, bool) and window > limit:
        raise f.fail("attn", f"has window_size {window}, larger than max_position_embeddings ({limit})")
    options = AttentionOptions(
        d_model=common.hidden_size, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rope_theta=sub.number("rope_theta"), window=window, qkv_bias=sub.flag("qkv_bias"), norm_eps=common.norm_eps,
    )
    return {i: options for i in layers}


def build(family: Family, source: dict[str, Any], options: Any, common: Common, attn: dict[int, AttentionOptions]) -> CausalLM:
    model = CausalLM(
        lambda i: Attention(attn[i]) if i in attn else (
            family.make_layer(options, common, i) if family.indexed else family.make_layer(options, common)
        ),
        n_layers=common.num_layers, vocab_size=common.vocab_size, d_model=common.hidden_size,
        mlp_hidden=common.mlp_hidden, norm_eps=common.norm_eps, tie_embeddings=common.tie_embeddings,
        chunk_size=family.chunk_size, config={"family": family.name, "chunk_size": family.chunk_size, "source_config": source},
        **family.skeleton(options, common),
    )
    limit = source.get("max_position_embeddings")
    if attn and isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        model.max_positions = limit  # a hybrid's attention was trained to this context; the runtime enforces it
    return model


# fla's module names -> the skeleton's (edgelin.skeleton): prefixes first, then fragments
SKELETON_RENAMES = [
    ("model.embeddings.", "embed."), ("model.layers.", "blocks."), ("model.norm.", "norm."),
    (".mlp.gate_proj.", ".mlp.gate."), (".mlp.up_proj.", ".mlp.up."), (".mlp.down_proj.", ".mlp.down."),
]


def load_fla(path: str | Path, family: Family) -> CausalLM:
    """Build the edgelin model of an fla checkpoint folder of ``family`` (eval mode, float32, CPU)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults={**COMMON_FIELDS, **family.fields}, refused=REFUSED_FIELDS,
                     importer=family.name, where=path / CONFIG_FILE)
    common = family.read_common(f)
    attn = read_attn(f, common)
    options = family.read(f, common)
    pairs = list(SKELETON_RENAMES)
    if common.tie_embeddings:
        pairs.append(("lm_head.weight", "embed.weight"))  # a tied checkpoint may hold either copy
    rename = Renamer(pairs + family.renames(options))
    return load_checkpoint_weights(ckpt, lambda: build(family, source, options, common, attn), rename)

__all__ = ["COMMON_FIELDS", "Common", "Family", "load_fla", "read_attn"]
