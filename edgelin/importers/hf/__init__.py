"""Hugging Face transformers checkpoints, imported onto edgelin's one model skeleton (edgelin.skeleton).

One module per ``model_type``; each reads its config with the shared field framework (edgelin.importers.fields),
builds ``edgelin.skeleton.CausalLM`` from the registered mixer kinds, and loads the weights with the shared
matching (edgelin.importers.weights). Families: ``qwen3_5`` (Qwen3.5's text model, also from the vision-language
checkpoint) in ``edgelin.importers.hf.qwen3_5``, ``qwen3_next`` (its dense models, the fused projections unpacked
at load time) in ``edgelin.importers.hf.qwen3_next``, ``lfm2`` (LFM2 and LFM2.5: gated short convs and attention) in
``edgelin.importers.hf.lfm2``. docs/importers.md lists every config field each reads.
"""

from __future__ import annotations

from edgelin.importers.fields import Fields

ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def read_rope(
    f: Fields, head_dim: int, *, importer: str, default_theta: float, default_factor: float = 1.0, extra_keys: tuple[str, ...] = ()
) -> tuple[float, int]:
    """(rope_theta, rotary width) from ``rope_parameters`` (transformers 5) or the older top-level ``rope_theta``,
    ``partial_rotary_factor`` and ``rope_scaling``. Only the default RoPE (no scaling); ``extra_keys``: keys the
    family accepts without effect on text (Qwen3.5's multimodal sections)."""
    params = f.data.get("rope_parameters") or f.data.get("rope_scaling") or {}  # (fields a family lacks are refused before)
    if not isinstance(params, dict):
        raise f.fail("rope_parameters", f"must be an object, got {str(params)[:60]}")
    unknown = sorted(set(params) - ROPE_KEYS - set(extra_keys))
    if unknown:
        raise f.fail("rope_parameters", f"has the key {unknown[0]!r}, unknown to edgelin's {importer} importer; it may change the model")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise f.unsupported("rope_parameters", f"has rope_type {kind!r}; edgelin supports 'default' (RoPE scaling is not supported)")
    theta = params.get("rope_theta", f.data.get("rope_theta"))
    factor = params.get("partial_rotary_factor", f.data.get("partial_rotary_factor"))
    theta = default_theta if theta is None else theta
    factor = default_factor if factor is None else factor
    for name, value in (("rope_theta", theta), ("partial_rotary_factor", factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise f.fail("rope_parameters", f"has {name} {value!r}; it must be a positive number")
    rotary = int(head_dim * factor)
    if rotary % 2 or not 0 < rotary <= head_dim:
        raise f.fail("rope_parameters", f"gives a rotary width head_dim * partial_rotary_factor = {rotary}; it must be even and at most head_dim")
    return float(theta), rotary


def attention_heads(f: Fields, hidden: int) -> tuple[int, int, int]:
    """(num_attention_heads, num_key_value_heads, head_dim): KV heads default to the heads, head_dim to hidden /
    heads (transformers' getattr(config, "head_dim", hidden // heads))."""
    heads = f.integer("num_attention_heads")
    kv_heads = f.integer("num_key_value_heads", optional=True) or heads
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads ({heads}), got {kv_heads}")
    head_dim = f.integer("head_dim", optional=True)
    if head_dim is None:
        if hidden % heads:
            raise f.fail("num_attention_heads", f"must divide hidden_size ({hidden}) when head_dim is not set, got {heads}")
        head_dim = hidden // heads
    return heads, kv_heads, head_dim


def declare_context(model, source: dict, has_attention: bool):
    """A hybrid's attention was trained to ``max_position_embeddings``: the model declares it as its context limit
    (the runtimes enforce it); a stack without attention declares none. Returns the model."""
    limit = source.get("max_position_embeddings")
    if has_attention and isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        model.max_positions = limit
    return model


__all__ = ["ROPE_KEYS", "attention_heads", "declare_context", "read_rope"]
