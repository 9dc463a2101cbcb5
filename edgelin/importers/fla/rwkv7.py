"""fla's ``rwkv7`` (RWKV7ForCausalLM): the time mix and channel mix of edgelin.layers.rwkv7 on the skeleton.

fla's block (``fla/models/rwkv7/modeling_rwkv7.py``): layer 0 norms the embeddings first (``pre_norm``, with
``norm_first``), then every block is pre-norm, x + time_mix(attn_norm(x)), x + channel_mix(ffn_norm(x)), all norms
LayerNorms (with a bias unless ``norm_bias`` is false); a final LayerNorm and the head. On the skeleton: ``embed_norm``,
``norm=LayerNorm``, the channel mix as the blocks' MLP (its token shift is the MLP's state), v_first in the per-call
carry. The channel mix's width: ``intermediate_size``, else hidden_size * hidden_ratio rounded up to a multiple of 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgelin.importers.fields import Fields
from edgelin.importers.fla import Common, Family, load_fla
from edgelin.layers.norms import BiaslessLayerNorm, LayerNorm
from edgelin.layers.rwkv7 import RWKV7ChannelMix, RWKV7Options, RWKV7TimeMix
from edgelin.ops.dplr import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM

ATTN_MODES = ("chunk", "fused_recurrent")  # which of fla's kernels computes the same math: no effect here

# RWKV7Config's own fields with fla's defaults (the shared ones are edgelin.importers.fla.COMMON_FIELDS';
# fuse_cross_entropy, fuse_linear_cross_entropy and use_l2warp are training options, accepted without effect)
FIELDS: dict[str, Any] = {
    "attn_mode": "chunk", "head_dim": 64, "num_heads": None, "decay_low_rank_dim": 64, "gate_low_rank_dim": 128,
    "a_low_rank_dim": 64, "v_low_rank_dim": 16, "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True,
    "norm_eps": 1e-5, "value_dim": None, "use_l2warp": True,
}


def read_common(f: Fields) -> Common:
    """The shared sizes with RWKV-7's channel mix: squared ReLU only, the width rounded up to a multiple of 32."""
    f.choice("hidden_act", ("sqrelu",))
    for name in ("fuse_cross_entropy", "fuse_linear_cross_entropy", "use_l2warp"):
        f.flag(name)  # training options: the same model at inference
    return Common.sizes(f, share=1, multiple=32)  # fla's RWKV7FeedForward: hidden_ratio whole, up to a multiple of 32


def low_rank(f: Fields, name: str, default: float) -> int:
    """A LoRA's rank, or fla's default from the sizes when null (RWKV7Attention's formula)."""
    return f.integer(name, optional=True) or default


@dataclass(frozen=True)
class RWKV7Model:
    """What an RWKV-7 config sets: each time mix's options and the norms (``norm_first``: the embeddings' norm)."""

    layer: RWKV7Options
    norm_first: bool
    norm_bias: bool


def read(f: Fields, common: Common) -> RWKV7Model:
    if f.get("attn") is not None:
        raise f.unsupported("attn", "asks for softmax attention layers inside an RWKV-7 model (a hybrid), which fla 0.6 "
                                    "itself cannot run (its RWKV7Block unpacks four values from its Attention, which "
                                    "returns three); export a model without 'attn'")
    f.choice("attn_mode", ATTN_MODES)
    hidden = common.hidden_size
    head_dim = f.integer("head_dim", optional=True)
    if head_dim is None:  # fla reads num_heads only when head_dim is null
        heads = f.integer("num_heads", optional=True)
        if heads is None:
            raise f.fail("head_dim", "and 'num_heads' are both null; set one of them")
        if hidden % heads:
            raise f.fail("num_heads", f"is {heads}, which does not divide hidden_size ({hidden})")
        head_dim = hidden // heads
    elif hidden % head_dim:
        raise f.fail("head_dim", f"is {head_dim}, which does not divide hidden_size ({hidden})")
    heads = hidden // head_dim
    value_dim = f.get("value_dim")
    widths = [hidden] * common.num_layers if value_dim is None else value_dim
    if isinstance(widths, int) and not isinstance(widths, bool):
        widths = [widths] * common.num_layers
    if (not isinstance(widths, list) or len(widths) != common.num_layers
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in widths)):
        raise f.fail("value_dim", f"must be a positive integer, a list of {common.num_layers} of them, or null; "
                                  f"got {value_dim!r}")
    if set(widths) != {hidden}:
        raise f.unsupported("value_dim", f"is {value_dim!r}; edgelin imports RWKV-7 with values as wide as hidden_size "
                                         f"({hidden}) only (fla 0.6 cannot build a model with wider values: its layer init "
                                         "fails), so export a checkpoint with value_dim null or equal to hidden_size")
    factor = head_dim / 64
    layer = RWKV7Options(
        hidden_size=hidden, num_heads=heads, head_dim=head_dim, value_dim=widths[0],
        decay_low_rank_dim=low_rank(f, "decay_low_rank_dim", max(32, int(round(2.5 * hidden**0.5 * factor / 32) * 32))),
        gate_low_rank_dim=low_rank(f, "gate_low_rank_dim", max(32, int(round(5 * hidden**0.5 / 32) * 32))),
        a_low_rank_dim=low_rank(f, "a_low_rank_dim", max(32, int(round(2.5 * hidden**0.5 * factor / 32) * 32))),
        v_low_rank_dim=low_rank(f, "v_low_rank_dim", max(32, int(round(1.7 * hidden**0.5 * factor / 32) * 32))),
        norm_eps=common.norm_eps, fuse_norm=f.flag("fuse_norm"),
    )
    return RWKV7Model(layer=layer, norm_first=f.flag("norm_first"), norm_bias=f.flag("norm_bias"))


def make_layer(model: RWKV7Model, common: Common, layer: int) -> RWKV7TimeMix:
    return RWKV7TimeMix(model.layer, layer)


def skeleton(model: RWKV7Model, common: Common) -> dict[str, Any]:
    norm = LayerNorm if model.norm_bias else BiaslessLayerNorm
    return {"norm": norm, "mlp": RWKV7ChannelMix, "embed_norm": model.norm_first}


FAMILY = Family(
    name="fla/rwkv7",
    fields=FIELDS,
    read=read,
    make_layer=make_layer,
    # fla's names -> the skeleton's (after edgelin.importers.fla's "model.layers." -> "blocks.")
    renames=lambda options: [(".ffn_norm.", ".mlp_norm."), (".ffn.", ".mlp."), ("blocks.0.pre_norm.", "embed_norm.")],
    chunk_size=DEFAULT_CHUNK,
    read_common=read_common,
    skeleton=skeleton,
    indexed=True,
)


def load(path: str | Path) -> CausalLM:
    return load_fla(path, FAMILY)


__all__ = ["FAMILY", "RWKV7Model", "load", "read", "read_common"]
