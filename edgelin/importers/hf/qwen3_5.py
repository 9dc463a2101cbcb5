"""transformers' ``qwen3_5_text`` (Qwen3_5ForCausalLM) and ``qwen3_5`` (Qwen3_5ForConditionalGeneration: its text
model; the vision tower is left out): their configs read onto Qwen's hybrid (edgelin.importers.hf.qwen_hybrid has
the layers and the math)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import check_fields
from edgelin.importers.hf.qwen_hybrid import LEFT_OUT, TEXT_FIELDS, build
from edgelin.importers.weights import load_checkpoint_weights
from edgelin.skeleton import CausalLM


MOE = "mixture-of-experts layers (the qwen3_5_moe model type); edgelin exports dense MLPs only"


REFUSED_FIELDS = {
    "num_experts": MOE, "num_experts_per_tok": MOE, "moe_intermediate_size": MOE,
    "shared_expert_intermediate_size": MOE, "decoder_sparse_step": MOE, "mlp_only_layers": MOE,
}


# The multimodal wrapper's own fields; its text model is text_config.
WRAPPER_FIELDS: dict[str, Any] = {
    "text_config": None, "vision_config": None, "tie_word_embeddings": False, "image_token_id": None,
    "video_token_id": None, "vision_start_token_id": None, "vision_end_token_id": None,
}


def load_text(path: str | Path) -> CausalLM:
    """A ``qwen3_5_text`` checkpoint folder (Qwen3_5ForCausalLM)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=TEXT_FIELDS, refused=REFUSED_FIELDS, importer="hf/qwen3_5_text", where=path / CONFIG_FILE)
    make, rename = build(f, source=source, family="hf/qwen3_5_text")
    return load_checkpoint_weights(ckpt, make, rename, left_out=LEFT_OUT)


def load(path: str | Path) -> CausalLM:
    """A ``qwen3_5`` checkpoint folder (Qwen3_5ForConditionalGeneration): its text model, without the vision tower."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    where = path / CONFIG_FILE
    wrapper = check_fields(source, defaults=WRAPPER_FIELDS, refused={}, importer="hf/qwen3_5", where=where)
    text = wrapper.get("text_config")
    if not isinstance(text, dict):
        raise wrapper.fail("text_config", "must be an object (the text model's config)")
    f = check_fields(text, defaults=TEXT_FIELDS, refused=REFUSED_FIELDS, importer="hf/qwen3_5", where=where)
    make, rename = build(f, tie=wrapper.flag("tie_word_embeddings"), source=source, family="hf/qwen3_5")
    model = load_checkpoint_weights(ckpt, make, rename, left_out=LEFT_OUT)
    model.config["left_out"] = "the vision tower (vision_config, model.visual.*): the export is the text model"
    return model


__all__ = ["load", "load_text"]
