"""Falcon-H1 in the transformers oracle (testkit.hf_oracle): its config and model classes, and its cache, whose every
layer holds both a KV cache and Mamba2's states (one cache layer per hybrid layer)."""

from __future__ import annotations

CLASSES = ("FalconH1Config", "FalconH1ForCausalLM")


def cache_tensors(cache, out: dict) -> None:
    """Per layer "{i}.key" / "{i}.value" (attention) and "{i}.recurrent" [B, H, P, N] / "{i}.conv" (Mamba2)."""
    for i, layer in enumerate(cache.layers):
        out[f"{i}.key"], out[f"{i}.value"] = layer.keys, layer.values
        out[f"{i}.recurrent"], out[f"{i}.conv"] = cache.get_recurrent_state(i), cache.get_conv_state(i)
