"""transformers' Lfm2MoeForCausalLM as the oracle (testkit.hf_oracle): its classes, and a perturbation whose routing
has clear margins (router weights of std 0.3 on normed inputs: logits of std ~2.4, so no top-k choice sits within
float32 rounding of a tie) and a non-zero expert_bias (a buffer the default perturbation leaves at zero)."""

import torch

CLASSES = ("Lfm2MoeConfig", "Lfm2MoeForCausalLM")


def perturb(model, gen) -> None:
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif "embed" in name or "lm_head" in name:
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("feed_forward.gate.weight"):  # the router
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("expert_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif p.is_floating_point() and "inv_freq" not in name:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
