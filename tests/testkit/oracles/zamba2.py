"""transformers' Zamba2 in the oracle (testkit.hf_oracle): its classes, and a cache whose hybrid layers hold both a KV
cache and Mamba2's states."""

CLASSES = ("Zamba2Config", "Zamba2ForCausalLM")


def cache_tensors(cache, out: dict) -> None:
    """out["{i}.recurrent" / "{i}.conv"] for every layer, and "{i}.key" / "{i}.value" for the hybrid layers."""
    for i, layer in enumerate(cache.layers):
        out[f"{i}.recurrent"], out[f"{i}.conv"] = cache.get_recurrent_state(i), cache.get_conv_state(i)
        if getattr(layer, "keys", None) is not None:
            out[f"{i}.key"], out[f"{i}.value"] = layer.keys, layer.values
