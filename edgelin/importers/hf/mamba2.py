"""transformers' ``mamba2`` (Mamba2ForCausalLM) on the skeleton, as transformers 5.x computes it: embeddings ->
blocks of (RMSNorm -> Mamba2 mixer -> residual; no MLP) -> norm_f -> lm_head. The mixer is edgelin.layers.mamba2's
(kind "mamba2": the SSD recurrence on the linear-attention forms with a per-head decay); norms are plain
RMSNorm x / rms(x) * w.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.hf import mixer_renames, read_time_step_limit
from edgelin.importers.fields import check_fields
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.mamba2 import Mamba2Mixer, Mamba2Options
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM


FIELDS: dict[str, Any] = {  # Mamba2Config's fields and defaults (transformers 5.x)
    "num_heads": 128, "head_dim": 64, "vocab_size": 32768, "hidden_size": 4096, "state_size": 128,
    "num_hidden_layers": 64, "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 8,
    "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "tie_word_embeddings": False,
    "time_step_limit": [0.0, math.inf],
    "residual_in_fp32": True,  # the residual stream's dtype in a half-precision model: edgelin's is float32 anyway
    # initialisation only, or a kernel's block size: no effect at inference
    "time_step_rank": "auto", "time_step_min": 0.001, "time_step_max": 0.1, "time_step_floor": 1e-4,
    "rescale_prenorm_residual": False, "chunk_size": 256,
    # stored by transformers' config but never read by its model (gating before the norm is built in)
    "norm_before_gate": None, "rms_norm": None, "layer_types": None,
}


def load(path: str | Path) -> CausalLM:
    """A ``mamba2`` checkpoint folder (Mamba2ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=FIELDS, refused={}, importer="hf/mamba2", where=path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))
    hidden, heads, head_dim = f.integer("hidden_size"), f.integer("num_heads"), f.integer("head_dim")
    if hidden * f.integer("expand") != heads * head_dim:
        raise f.fail("num_heads", f"times head_dim ({heads} x {head_dim}) must equal hidden_size x expand ({hidden} x {f.get('expand')})")
    groups = f.integer("n_groups")
    if heads % groups:
        raise f.fail("n_groups", f"must divide num_heads ({heads}), got {groups}")
    if f.get("norm_before_gate") is True:
        raise f.fail("norm_before_gate", "is true; transformers' Mamba2 gates before the norm, and so does edgelin")
    kinds = f.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or any(k not in ("mamba", "linear_attention") for k in kinds)):
        raise f.fail("layer_types", f"must list only Mamba2 layers; got {str(kinds)[:80]}")
    limit = read_time_step_limit(f)
    options = Mamba2Options(
        d_model=hidden, num_heads=heads, head_dim=head_dim, state_size=f.integer("state_size"), n_groups=groups,
        conv_kernel=f.integer("conv_kernel"), conv_bias=f.flag("use_conv_bias"), bias=f.flag("use_bias"),
        norm_eps=f.number("layer_norm_epsilon"), dt_min=limit[0], dt_max=limit[1],
    )
    f.flag("residual_in_fp32")
    tie, vocab, n_layers = f.flag("tie_word_embeddings"), f.integer("vocab_size"), f.integer("num_hidden_layers")

    def make() -> CausalLM:
        return CausalLM(
            lambda i: Mamba2Mixer(options), n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=None,
            norm_eps=options.norm_eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            config={"family": "hf/mamba2", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )

    pairs = [
        ("backbone.embeddings.", "embed."), ("backbone.embedding.", "embed."),  # (the older name transformers renames)
        ("backbone.layers.", "blocks."), ("backbone.norm_f.", "norm."),
        *mixer_renames("mixer"), (".norm.", ".attn_norm."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


__all__ = ["FIELDS", "load", "mixer_renames", "read_time_step_limit"]
