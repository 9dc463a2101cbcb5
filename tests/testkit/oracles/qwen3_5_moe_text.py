"""transformers' Qwen3_5MoeForCausalLM as the oracle (testkit.hf_oracle): its classes, and the perturbation of
Qwen3.5's (zero-centred norms around 0, the gated delta rule's output norm around 1) with routers of clear margins
(std 0.3 on normed inputs: softmax logits of std ~2.4, no top-k choice within float32 rounding of a tie)."""

import torch

CLASSES = ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")


def perturb(model, gen) -> None:
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):  # a plain weight
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):  # zero-centred: (1 + w)
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        elif "embed" in name or "lm_head" in name or name.endswith(("A_log", "dt_bias")):
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith(("mlp.gate.weight", "mlp.shared_expert_gate.weight")):  # the router; the shared expert's gate
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        else:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
