"""transformers' Qwen3NextForCausalLM as the oracle (testkit.hf_oracle): Qwen3.5-MoE's perturbation (zero-centred
norms around 0, the gated delta rule's output norm around 1, routers and shared-expert gates of std 0.3: routing with
clear margins). A dense model draws exactly the default perturbation's numbers (no router, the same order)."""

from testkit.oracles.qwen3_5_moe_text import perturb

__all__ = ["perturb"]
