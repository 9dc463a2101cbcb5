"""transformers' NemotronHForCausalLM with "moe" layers as the oracle (testkit.hf_oracle; a name of its own so that
the dense Nemotron-H cases keep the default perturbation): the default perturbation (norms around 1, embeddings and
the head, A_log and dt_bias by 0.3, the rest by 0.05), routers of clear margins (std 0.3 on normed inputs: sigmoid
scores spread over (0, 1)) and a non-zero score-correction bias (a buffer the default perturbation leaves at zero)."""

import torch

CLASSES = ("NemotronHConfig", "NemotronHForCausalLM")


def perturb(model, gen) -> None:
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif "embed" in name or "lm_head" in name or name.endswith(("A_log", "dt_bias")):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mixer.gate.weight"):  # the router
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        else:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.6 * torch.randn(b.shape, generator=gen))
