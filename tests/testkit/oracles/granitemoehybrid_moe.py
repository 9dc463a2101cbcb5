"""transformers' GraniteMoeHybridForCausalLM with experts as the oracle (testkit.hf_oracle; a name of its own so that
the dense Granite cases keep the default perturbation): the default perturbation (norms around 1, embeddings and the
head, A_log and dt_bias by 0.3, the rest by 0.05) with routers of clear margins (std 0.3 on normed inputs: logits of
std ~1.7, no top-k choice within float32 rounding of a tie)."""

import torch

CLASSES = ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM")


def perturb(model, gen) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif "embed" in name or "lm_head" in name or name.endswith(("A_log", "dt_bias")):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("block_sparse_moe.router.weight"):
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        else:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
