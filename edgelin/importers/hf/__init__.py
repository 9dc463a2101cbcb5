"""Hugging Face transformers checkpoints, imported onto edgelin's one model skeleton (edgelin.skeleton).

One module per ``model_type``; each reads its config with the shared field framework (edgelin.importers.fields),
builds ``edgelin.skeleton.CausalLM`` from the registered mixer kinds, and loads the weights with the shared
matching (edgelin.importers.weights); what several families read alike is here (RoPE, attention heads, the
declared context, the Mamba2 layer of Mamba2 and its hybrids). Families: ``qwen3_5`` (Qwen3.5's text model, also from the vision-language
checkpoint) in ``edgelin.importers.hf.qwen3_5``, ``qwen3_next`` (dense or with experts, the fused projections unpacked
at load time) in ``edgelin.importers.hf.qwen3_next``, ``lfm2`` (LFM2 and LFM2.5: gated short convs and attention) in
``edgelin.importers.hf.lfm2``. docs/importers.md lists every config field each reads.
"""

from __future__ import annotations

import math

from edgelin.importers.fields import Fields
from edgelin.layers.mamba2 import Mamba2Options

ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}


def rope_object(
    f: Fields, params: object, *, importer: str, types: tuple[str, ...], where: str = "", extra_keys: tuple[str, ...] = ()
) -> str:
    """Check one object of RoPE parameters (``rope_parameters``, or one of its per-layer-type entries): an object, no
    key unknown to edgelin (``ROPE_KEYS`` and ``extra_keys``), a rope_type among ``types``. Returns the rope_type.
    ``where`` names the entry in the messages (LFM3's "['full_attention'] ")."""
    if not isinstance(params, dict):
        raise f.fail("rope_parameters", f"{where}must be an object, got {str(params)[:60]}")
    unknown = sorted(set(params) - ROPE_KEYS - set(extra_keys))
    if unknown:
        raise f.fail("rope_parameters", f"{where}has the key {unknown[0]!r}, unknown to edgelin's {importer} importer; "
                                        "it may change the model")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in types:
        said = " and ".join(repr(t) for t in types if t != "mrope")  # mrope: Qwen3.5's multimodal sections, text as default
        raise f.unsupported("rope_parameters", f"{where}has rope_type {kind!r}; edgelin supports {said} "
                                               "(RoPE scaling is not supported)")
    return kind


def read_rope(
    f: Fields, head_dim: int, *, importer: str, default_theta: float, default_factor: float = 1.0, extra_keys: tuple[str, ...] = ()
) -> tuple[float, int]:
    """(rope_theta, rotary width) from ``rope_parameters`` (transformers 5) or the older top-level ``rope_theta``,
    ``partial_rotary_factor`` and ``rope_scaling``. Only the default RoPE (no scaling); ``extra_keys``: keys the
    family accepts without effect on text (Qwen3.5's multimodal sections)."""
    params = f.data.get("rope_parameters") or f.data.get("rope_scaling") or {}  # (fields a family lacks are refused before)
    rope_object(f, params, importer=importer, types=("default", "mrope"), extra_keys=extra_keys)
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


def read_time_step_limit(f: Fields) -> tuple[float, float]:
    """``time_step_limit`` as (low, high); transformers writes infinity as {"__float__": "Infinity"}."""
    limit = f.get("time_step_limit")
    if isinstance(limit, (list, tuple)):
        limit = [float(v["__float__"]) if isinstance(v, dict) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "inf")
                 else v for v in limit]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit) \
            or not 0 <= limit[0] <= limit[1]:
        raise f.fail("time_step_limit", f"must be [low, high] with 0 <= low <= high, got {limit!r}")
    return float(limit[0]), float(limit[1])


def time_step_rank(f: Fields, name: str, hidden: int) -> int:
    """Mamba-1's dt rank (field ``name``): an integer, or "auto" for ceil(hidden_size / 16) (transformers' rule)."""
    return math.ceil(hidden / 16) if f.get(name) == "auto" else f.integer(name)


def mixer_renames(module: str) -> list[tuple[str, str]]:
    """transformers' Mamba2 mixer module (``mixer``, Bamba's and Granite's ``mamba``) -> the skeleton's mixer."""
    return [(f".{module}.norm.", ".attn.gate_norm_"), (f".{module}.", ".attn.")]  # gate_norm_weight: the gated norm


def mamba_options(f: Fields, hidden: int, *, d_ssm: int | None = None, **options) -> Mamba2Options:
    """The Mamba2 layer of a hybrid config (Bamba's and Granite-4.0-H's ``mamba_*`` fields). ``d_ssm``: the layer's
    inner width where the config gives it (Falcon-H1's ``mamba_d_ssm``) instead of mamba_expand x hidden_size;
    ``options``: further Mamba2Options fields (Falcon-H1's norm and bias options)."""
    heads, expand = f.integer("mamba_n_heads"), f.integer("mamba_expand")
    inner = expand * hidden if d_ssm is None else d_ssm
    head_dim = f.get("mamba_d_head")
    if head_dim == "auto":
        head_dim = inner // heads
    head_dim = head_dim if isinstance(head_dim, int) and not isinstance(head_dim, bool) else None
    if head_dim is None or head_dim * heads != inner:
        width = f"mamba_expand x hidden_size ({expand} x {hidden})" if d_ssm is None else f"mamba_d_ssm ({d_ssm})"
        raise f.fail("mamba_d_head", f"times mamba_n_heads ({heads}) must equal {width}")
    groups = f.integer("mamba_n_groups")
    if heads % groups:
        raise f.fail("mamba_n_groups", f"must divide mamba_n_heads ({heads}), got {groups}")
    low, high = read_time_step_limit(f)
    return Mamba2Options(
        d_model=hidden, num_heads=heads, head_dim=head_dim, state_size=f.integer("mamba_d_state"), n_groups=groups,
        conv_kernel=f.integer("mamba_d_conv"), conv_bias=f.flag("mamba_conv_bias"), bias=f.flag("mamba_proj_bias"),
        norm_eps=f.number("rms_norm_eps"), dt_min=low, dt_max=high, **options,
    )


__all__ = ["ROPE_KEYS", "attention_heads", "declare_context", "mamba_options", "mixer_renames", "read_rope", "read_time_step_limit",
           "rope_object", "time_step_rank"]
