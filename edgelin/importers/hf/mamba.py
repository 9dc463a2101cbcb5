"""transformers' ``mamba`` (MambaForCausalLM) and ``falcon_mamba`` (FalconMambaForCausalLM) on the skeleton, as
transformers 5.x computes them: embeddings -> blocks of (RMSNorm -> Mamba-1 mixer -> residual; no MLP) -> norm_f ->
lm_head (tied to the embeddings by default). The mixer is edgelin.layers.mamba's (kind "mamba": the selective scan,
a decay per channel and state element); norms are plain RMSNorm x / rms(x) * w. Falcon-Mamba's mixer adds RMSNorms
without a weight on dt (before dt_proj), B and C, with epsilon ``mixer_rms_eps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import check_fields
from edgelin.importers.hf import time_step_rank
from edgelin.importers.weights import Renamer, load_checkpoint_weights
from edgelin.layers.mamba import MambaMixer, MambaOptions
from edgelin.protocol import DEFAULT_CHUNK
from edgelin.skeleton import CausalLM


FIELDS: dict[str, Any] = {  # MambaConfig's fields and defaults (transformers 5.x)
    "vocab_size": 50280, "hidden_size": 768, "state_size": 16, "num_hidden_layers": 32, "layer_norm_epsilon": 1e-5,
    "expand": 2, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "hidden_act": "silu", "time_step_rank": "auto",
    "tie_word_embeddings": True,
    "residual_in_fp32": True,  # the residual stream's dtype in a half-precision model: edgelin's is float32 anyway
    # initialisation only (dt_proj's init, out_proj's rescale) or a training-time scan choice: no effect at inference
    "time_step_scale": 1.0, "time_step_min": 0.001, "time_step_max": 0.1, "time_step_init_scheme": "random",
    "time_step_floor": 1e-4, "rescale_prenorm_residual": False, "use_mambapy": False, "use_associative_scan": True,
    # written by transformers as expand * hidden_size and recomputed from them when it loads the config
    "intermediate_size": None,
}
FALCON_FIELDS: dict[str, Any] = {
    **FIELDS, "mixer_rms_eps": 1e-6,
    "use_falcon_mambapy": False,  # the older name of use_mambapy (a training-time scan choice)
}


def _load(path: str | Path, family: str, fields: dict[str, Any]) -> CausalLM:
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=fields, refused={}, importer=f"hf/{family}", where=path / CONFIG_FILE)
    f.choice("hidden_act", ("silu",))  # the conv's activation
    hidden, expand = f.integer("hidden_size"), f.integer("expand")
    falcon = family == "falcon_mamba"
    options = MambaOptions(
        d_model=hidden, inner=expand * hidden, state_size=f.integer("state_size"),
        dt_rank=time_step_rank(f, "time_step_rank", hidden),
        conv_kernel=f.integer("conv_kernel"), conv_bias=f.flag("use_conv_bias"), bias=f.flag("use_bias"),
        bcdt_norm="fixed" if falcon else None, bcdt_eps=f.number("mixer_rms_eps") if falcon else 1e-6,
    )
    f.flag("residual_in_fp32")
    eps, tie = f.number("layer_norm_epsilon"), f.flag("tie_word_embeddings")
    vocab, n_layers = f.integer("vocab_size"), f.integer("num_hidden_layers")

    def make() -> CausalLM:
        return CausalLM(
            lambda i: MambaMixer(options), n_layers=n_layers, vocab_size=vocab, d_model=hidden, mlp_hidden=None,
            norm_eps=eps, tie_embeddings=tie, chunk_size=DEFAULT_CHUNK,
            config={"family": f"hf/{family}", "chunk_size": DEFAULT_CHUNK, "source_config": source},
        )

    older = [] if falcon else [("backbone.embedding.", "embed.")]  # the older name MambaModel's load hook renames
    pairs = [
        ("backbone.embeddings.", "embed."), *older, ("backbone.layers.", "blocks."), ("backbone.norm_f.", "norm."),
        (".mixer.", ".attn."), (".norm.", ".attn_norm."),
    ]
    if tie:
        pairs.append(("lm_head.weight", "embed.weight"))
    return load_checkpoint_weights(ckpt, make, Renamer(pairs))


def load(path: str | Path) -> CausalLM:
    """A ``mamba`` checkpoint folder (MambaForCausalLM)."""
    return _load(path, "mamba", FIELDS)


def load_falcon_mamba(path: str | Path) -> CausalLM:
    """A ``falcon_mamba`` checkpoint folder (FalconMambaForCausalLM)."""
    return _load(path, "falcon_mamba", FALCON_FIELDS)


__all__ = ["FALCON_FIELDS", "FIELDS", "load", "load_falcon_mamba", "time_step_rank"]
