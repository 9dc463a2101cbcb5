"""transformers' ``qwen3_5_text`` (Qwen3_5ForCausalLM) and ``qwen3_5`` (Qwen3_5ForConditionalGeneration: its text
model; the vision tower is left out): their configs read onto Qwen's hybrid (edgelin.importers.hf.qwen_hybrid has
the layers and the math); and their mixture-of-experts kind, ``qwen3_5_moe_text`` (``load_moe_text``:
Qwen3_5MoeForCausalLM) and ``qwen3_5_moe`` (``load_moe``: Qwen3_5MoeForConditionalGeneration, its text model), Qwen3.5's
hybrid with, as transformers 5.x computes it, every block's MLP a mixture of experts (edgelin.layers.moe; the rules in
edgelin.importers.hf.qwen_hybrid's ``read_moe``, shared with Qwen3-Next): its chosen scores always divided by their sum
(Qwen3.5-MoE's router renormalises with no epsilon and no scaling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.checkpoint import open_checkpoint
from edgelin.importers import CONFIG_FILE
from edgelin.importers.fields import Fields, check_fields
from edgelin.importers.hf.qwen_hybrid import LEFT_OUT, MOE_RENAMES, TEXT_FIELDS, build, read_moe
from edgelin.importers.weights import load_checkpoint_weights
from edgelin.layers.moe import MoE
from edgelin.skeleton import CausalLM


MOE = "mixture-of-experts layers: a Qwen3.5-MoE checkpoint says model_type qwen3_5_moe or qwen3_5_moe_text, which edgelin reads"


REFUSED_FIELDS = {
    "num_experts": MOE, "num_experts_per_tok": MOE, "moe_intermediate_size": MOE,
    "shared_expert_intermediate_size": MOE, "decoder_sparse_step": MOE, "mlp_only_layers": MOE,
}


# The multimodal wrapper's own fields; its text model is text_config.
WRAPPER_FIELDS: dict[str, Any] = {
    "text_config": None, "vision_config": None, "tie_word_embeddings": False, "image_token_id": None,
    "video_token_id": None, "vision_start_token_id": None, "vision_end_token_id": None,
}


def read_text(path: str | Path, *, fields: dict[str, Any] = TEXT_FIELDS, refused: dict[str, str] = REFUSED_FIELDS,
              family: str = "hf/qwen3_5_text", variant=None) -> CausalLM:
    """A text checkpoint folder of Qwen3.5's kind: ``fields`` and ``refused`` its config's, ``variant(f)`` the
    further keyword arguments of ``build`` a variant reads from the checked config (Qwen3.5-MoE's MLPs), and under
    "splits" the weights loader's (its experts' layout)."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    f = check_fields(source, defaults=fields, refused=refused, importer=family, where=path / CONFIG_FILE)
    options = variant(f) if variant else {}
    splits = options.pop("splits", ())
    make, rename = build(f, source=source, family=family, **options)
    return load_checkpoint_weights(ckpt, make, rename, left_out=LEFT_OUT, splits=splits)


def read_multimodal(path: str | Path, *, fields: dict[str, Any] = TEXT_FIELDS, refused: dict[str, str] = REFUSED_FIELDS,
                    family: str = "hf/qwen3_5", variant=None) -> CausalLM:
    """A vision-language checkpoint folder of Qwen3.5's kind: its text model (``read_text``'s arguments), without
    the vision tower."""
    ckpt = open_checkpoint(path)  # the folder read once (a Checkpoint passed in is not read again)
    path, source = ckpt.path, ckpt.config
    where = path / CONFIG_FILE
    wrapper = check_fields(source, defaults=WRAPPER_FIELDS, refused={}, importer=family, where=where)
    text = wrapper.get("text_config")
    if not isinstance(text, dict):
        raise wrapper.fail("text_config", "must be an object (the text model's config)")
    f = check_fields(text, defaults=fields, refused=refused, importer=family, where=where)
    options = variant(f) if variant else {}
    splits = options.pop("splits", ())
    make, rename = build(f, tie=wrapper.flag("tie_word_embeddings"), source=source, family=family, **options)
    model = load_checkpoint_weights(ckpt, make, rename, left_out=LEFT_OUT, splits=splits)
    model.config["left_out"] = "the vision tower (vision_config, model.visual.*): the export is the text model"
    return model


def load_text(path: str | Path) -> CausalLM:
    """A ``qwen3_5_text`` checkpoint folder (Qwen3_5ForCausalLM)."""
    return read_text(path)


def load(path: str | Path) -> CausalLM:
    """A ``qwen3_5`` checkpoint folder (Qwen3_5ForConditionalGeneration): its text model, without the vision tower."""
    return read_multimodal(path)



MOE_FIELDS: dict[str, Any] = {  # Qwen3_5MoeTextConfig's fields and defaults (transformers 5.x): Qwen3.5's, with experts for its MLP
    **{name: value for name, value in TEXT_FIELDS.items() if name != "intermediate_size"},
    "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "output_router_logits": False,  # training only: the router logits returned for an auxiliary loss
    "router_aux_loss_coef": 0.001,  # training only: that loss's weight
}


def moe(f: Fields) -> dict[str, Any]:
    """``build``'s MLP arguments from the checked text config (every block's MLP the mixture of experts, its chosen
    scores always renormalised), and the weights loader's splits of the experts' in-memory layout."""
    options, splits = read_moe(f, renormalise=True)
    return {"mlp": lambda i: (lambda sizes: MoE(options)), "mlp_hidden": options.expert_hidden, "renames": MOE_RENAMES, "splits": splits}


def load_moe_text(path: str | Path) -> CausalLM:
    """A ``qwen3_5_moe_text`` checkpoint folder (Qwen3_5MoeForCausalLM)."""
    return read_text(path, fields=MOE_FIELDS, refused={}, family="hf/qwen3_5_moe_text", variant=moe)


def load_moe(path: str | Path) -> CausalLM:
    """A ``qwen3_5_moe`` checkpoint folder (Qwen3_5MoeForConditionalGeneration): its text model, without the vision tower."""
    return read_multimodal(path, fields=MOE_FIELDS, refused={}, family="hf/qwen3_5_moe", variant=moe)


__all__ = ["MOE_FIELDS", "WRAPPER_FIELDS", "load", "load_moe", "load_moe_text", "load_text", "moe", "read_multimodal", "read_text"]
