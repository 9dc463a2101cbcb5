"""transformers' RecurrentGemmaForCausalLM as the oracle (testkit.hf_oracle's hooks).

Its recurrent blocks keep their state on the modules (``conv1d_state`` [B, lru_width, W - 1] and the RG-LRU's
``recurrent_states`` [B, lru_width]); only the local attention layers use the DynamicCache. The cache made here
remembers the model so that ``cache_tensors`` reads both. Decode steps are given their positions, as transformers'
generate does (without them the model counts them from its cache's first attention layer).
"""

from __future__ import annotations

CLASSES = ("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM")


def perturb(model, gen) -> None:
    """Weights whose effects show: zero-centred norms (1 + w) with w around 0, decays over a wide range, gates
    that vary, large embeddings (the tied head then gives logits the soft cap bends)."""
    import torch

    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("norm.weight"):
            p.copy_(0.3 * noise)
        elif name.endswith("recurrent_param"):
            p.copy_(-1.0 + 1.5 * noise)  # softplus from ~0.05 to ~2: per-step decays exp(-8 r softplus) from ~1 to ~0
        elif name.endswith(("gate_weight", "gate_bias")):
            p.add_(0.3 * noise)
        elif "embed" in name or "lm_head" in name:
            p.add_(0.5 * noise)
        else:
            p.add_(0.05 * noise)


def make_cache(cfg, model):
    import transformers

    cache = transformers.DynamicCache(config=cfg)
    cache.recurrent_gemma_model = model
    return cache


def step_kwargs(spec, t: int) -> dict:
    import torch

    batch, prompt = len(spec["prompt"]), len(spec["prompt"][0])
    return {"position_ids": torch.full((batch, 1), prompt + t, dtype=torch.long)}


def cache_tensors(cache, out: dict) -> None:
    """out["{i}.recurrent"] [B, lru_width] and out["{i}.conv"] [B, lru_width, W - 1] of each recurrent block,
    out["{i}.key"] / out["{i}.value"] [B, H_kv, min(P, W - 1), D] of each attention layer."""
    for i, layer in enumerate(cache.recurrent_gemma_model.model.layers):
        block = layer.temporal_block
        if hasattr(block, "rg_lru"):
            out[f"{i}.recurrent"], out[f"{i}.conv"] = block.rg_lru.recurrent_states, block.conv1d_state
        else:
            out[f"{i}.key"], out[f"{i}.value"] = cache.layers[i].keys, cache.layers[i].values
