"""transformers' ``qwen3_5_moe_text`` (Qwen3_5MoeForCausalLM) and ``qwen3_5_moe`` (Qwen3_5MoeForConditionalGeneration:
its text model; the vision tower is left out): Qwen3.5's hybrid (edgelin.importers.hf.qwen_hybrid, read as
edgelin.importers.hf.qwen3_5 reads it) with, as transformers 5.x computes it, every block's MLP a mixture of experts
(edgelin.layers.moe):

- router logits l = gate x (no bias), scores softmax(l); the top ``num_experts_per_tok`` chosen, their scores
  divided by their sum (always: Qwen3.5-MoE's router renormalises with no epsilon and no scaling)
- each expert a SwiGLU of width ``moe_intermediate_size`` (gate_proj, up_proj, down_proj)
- a shared expert, a SwiGLU of width ``shared_expert_intermediate_size``, times sigmoid(shared_expert_gate x),
  added to the experts' sum
- the experts' weights per expert (``mlp.experts.{e}.gate_proj`` ..., what save_pretrained writes) or in transformers'
  in-memory layout (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I])
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgelin.importers.fields import Fields
from edgelin.importers.hf.qwen3_5 import read_multimodal, read_text
from edgelin.importers.hf.qwen_hybrid import TEXT_FIELDS
from edgelin.importers.weights import ExpertSplit
from edgelin.layers.moe import MoE, MoEOptions
from edgelin.skeleton import CausalLM

FIELDS: dict[str, Any] = {  # Qwen3_5MoeTextConfig's fields and defaults (transformers 5.x): Qwen3.5's, with experts for its MLP
    **{name: value for name, value in TEXT_FIELDS.items() if name != "intermediate_size"},
    "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "output_router_logits": False,  # training only: the router logits returned for an auxiliary loss
    "router_aux_loss_coef": 0.001,  # training only: that loss's weight
}
RENAMES = (  # before Qwen3.5's: the router (``gate``), the shared expert and its gate, each expert's SwiGLU
    (".mlp.gate.", ".mlp.router."), (".mlp.shared_expert_gate.", ".mlp.shared_gate."), (".mlp.shared_expert.", ".mlp.shared."),
    (".gate_proj.", ".gate."), (".up_proj.", ".up."), (".down_proj.", ".down."),
)


def moe(f: Fields) -> dict[str, Any]:
    """``build``'s MLP arguments from the checked text config (every block's MLP the mixture of experts), and the
    weights loader's splits of the experts' in-memory layout."""
    hidden, experts, k = f.integer("hidden_size"), f.integer("num_experts"), f.integer("num_experts_per_tok")
    if k > experts:
        raise f.fail("num_experts_per_tok", f"must be at most num_experts ({experts}), got {k}")
    f.flag("output_router_logits")
    f.get("router_aux_loss_coef")
    options = MoEOptions(
        d_model=hidden, num_experts=experts, top_k=k, expert_hidden=f.integer("moe_intermediate_size"), scoring="softmax",
        renormalise=True, shared_hidden=f.integer("shared_expert_intermediate_size"), shared_gate=True,
    )
    splits = (ExpertSplit("experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"), experts),  # gate rows, then up
              ExpertSplit("experts.down_proj", ("down_proj.weight",), experts))
    return {"mlp": lambda i: (lambda sizes: MoE(options)), "mlp_hidden": options.expert_hidden, "renames": RENAMES, "splits": splits}


def load_text(path: str | Path) -> CausalLM:
    """A ``qwen3_5_moe_text`` checkpoint folder (Qwen3_5MoeForCausalLM)."""
    return read_text(path, fields=FIELDS, refused={}, family="hf/qwen3_5_moe_text", variant=moe)


def load(path: str | Path) -> CausalLM:
    """A ``qwen3_5_moe`` checkpoint folder (Qwen3_5MoeForConditionalGeneration): its text model, without the vision tower."""
    return read_multimodal(path, fields=FIELDS, refused={}, family="hf/qwen3_5_moe", variant=moe)


__all__ = ["FIELDS", "load", "load_text", "moe"]
