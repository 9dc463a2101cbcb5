"""Layer kinds: one module per kind of token-mixing layer, each owning its math in every form, its state layout and
its lowering hooks; the ops they run are in edgelin.ops (a naive reference beside each fast form).

    attention.py         softmax attention with a KV cache (RoPE, windows, gates, q/k norms)   kind "attention"
    linear_attention.py  linear attention with a feature map, decays, the delta rule; fla's     kinds "linear", "fla/linear_attn"
    gated.py             gated linear attention: RetNet's fixed decay, GLA's per-channel gate   kind "fla/gated"
    delta.py             the delta rule with fla's conventions (DeltaNet, Gated DeltaNet)      kind "fla/delta"
    mamba2.py            Mamba2's SSD recurrence                                                kind "mamba2"
    rwkv7.py             RWKV-7's time mix (DPLR recurrence) and its stateful channel mix (MLP) kind "fla/rwkv7"
    mamba.py             Mamba-1's selective scan (a decay per channel and state element)      kind "mamba"
    rg_lru.py            RecurrentGemma's recurrent block: temporal conv + RG-LRU              kind "rg_lru"
    parallel.py          several mixers on one input, their outputs summed (Falcon-H1)        kind "parallel"
    shared_block.py      Zamba2's hybrid layer: a shared attention+MLP block, then Mamba2       kind "zamba2/hybrid"
    short_conv.py        short causal convolutions, LFM2's gated short conv                    kind "short_conv"
    mlp.py               MLPs, and a layer that is only an MLP (Nemotron-H's)                   kind "mlp"
    feature_maps.py, norms.py, heads.py: pieces the kinds share

A kind is a ``torch.nn.Module`` registered by name in ``MIXERS`` (``register_mixer``); the skeleton
(edgelin.skeleton) builds blocks from them. A new kind is one new module here plus its ops. Importers only read
configs and rename weights onto these kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class LayerSizes:
    """The model-wide sizes a layer kind reads beside its own options (edgelin.importers.fla.Common carries them too)."""

    hidden_size: int
    norm_eps: float


MIXERS: dict[str, type[nn.Module]] = {}


def register_mixer(name: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    """Class decorator: register a mixer kind under ``name`` (its ``kind`` attribute is set to it)."""

    def register(cls: type[nn.Module]) -> type[nn.Module]:
        if name in MIXERS and MIXERS[name] is not cls:
            raise ValueError(f"mixer kind {name!r} is registered twice")
        cls.kind = name
        MIXERS[name] = cls
        return cls

    return register


def runs(mixer: nn.Module, form: str) -> bool:
    forms = getattr(mixer, "forms", ("chunk", "step"))
    return forms is None or form in forms


def check_form(mixer: nn.Module, form: str, lengths: torch.Tensor | None) -> None:
    """ValueError unless ``mixer`` runs ``form`` (and takes ``lengths`` if given): for a mixer called on its own."""
    if not runs(mixer, form):
        raise ValueError(f"{mixer.kind} layers run the forms {', '.join(mixer.forms)}, not {form!r}")
    if lengths is not None and not getattr(mixer, "accepts_lengths", False):
        raise ValueError(f"{mixer.kind} layers take no lengths (a ragged batch); prefill the rows one by one")


__all__ = ["MIXERS", "LayerSizes", "check_form", "register_mixer", "runs"]
