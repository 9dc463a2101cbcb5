"""fla's models as the bench's decay section builds them: fla's own config and model classes at the plan's widths,
random init, saved and read back through edgelin's importers (in an export worker: ``build_fla``)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

FLA_BASELINE = "gated_deltanet"
FLA_MODELS = {  # name -> (fla config class, model class, options beside the plan's widths)
    "gated_deltanet": ("GatedDeltaNetConfig", "GatedDeltaNetForCausalLM", {"expand_v": 1.0}),
    "kda": ("KDAConfig", "KDAForCausalLM", {"expand_v": 1.0}),
    "gated_deltaproduct": ("GatedDeltaProductConfig", "GatedDeltaProductForCausalLM",
                           {"expand_v": 1.0, "num_householder": 2, "use_forget_gate": True}),
    "rwkv7": ("RWKV7Config", "RWKV7ForCausalLM", {}),
}
FLA_VOCAB = 512
FLA_HINT = "pip install -e '.[test]' installs flash-linear-attention and triton"


def fla_config(name: str, widths: tuple[int, int, int, int]) -> dict[str, Any]:
    """fla's config fields of model ``name`` at ``widths`` (d_model, n_layers, n_heads, head_dim)."""
    d, layers, heads, head_dim = widths
    options = {"num_heads": heads} if name != "rwkv7" else {}
    return {"hidden_size": d, "num_hidden_layers": layers, "vocab_size": FLA_VOCAB, "intermediate_size": 3 * d,
            "head_dim": head_dim, **options, **FLA_MODELS[name][2]}


def build_fla(job: dict[str, Any]):
    """In an export worker: the job's fla model (fla's config class, seed MODEL_SEED, random init) saved to
    ``job["checkpoint"]``, then read back through edgelin's importer (the model exported)."""
    import torch

    from edgelin.checkpoint import load_checkpoint

    from .plan import MODEL_SEED

    models = importlib.import_module("fla.models")
    config_class, model_class, _ = FLA_MODELS[job["fla"]]
    torch.manual_seed(MODEL_SEED)
    getattr(models, model_class)(getattr(models, config_class)(**job["config"])).eval().save_pretrained(job["checkpoint"])
    return load_checkpoint(job["checkpoint"]).float().eval()


def fla_missing() -> str | None:
    """Why fla's models cannot be built here (fla or triton not installed), or None."""
    for module, what in (("fla", "flash-linear-attention"), ("triton", "triton (fla's models import it)")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed; {FLA_HINT}"
    return None


__all__ = ["FLA_BASELINE", "FLA_HINT", "FLA_MODELS", "FLA_VOCAB", "build_fla", "fla_config", "fla_missing"]
