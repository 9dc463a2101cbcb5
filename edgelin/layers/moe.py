"""A mixture-of-experts MLP (LFM2-MoE's, Qwen3.5-MoE's, Granite-4.0-H's, Nemotron-H's): a router, E experts (SwiGLU,
or relu^2 without a gate) of which each token runs its top k, optionally inside latent projections, and optionally
a shared expert every token runs (behind a sigmoid gate or not). It sits where a
block's MLP sits (``Block``'s ``mlp``: a function of the block's sizes) and, as a block of its own, in the mixer
kind "moe" (an MLP-only layer: no state, any form). The math is in edgelin.ops.moe (``route``, ``moe_experts``
and their naive references)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from edgelin.layers import register_mixer
from edgelin.layers.mlp import PackedSwiGLU, ReluSquaredMLP, SwiGLU
from edgelin.ops.moe import SCORINGS, module_experts, moe_experts, naive_moe, naive_route, route
from edgelin.state import State

EXPERT_KINDS = {"swiglu": SwiGLU, "relu2": ReluSquaredMLP}  # expert_kind -> its module
SHARED_KINDS = {**EXPERT_KINDS, "packed_swiglu": PackedSwiGLU}  # shared_kind -> its module


@dataclass(frozen=True)
class MoEOptions:
    """``scoring``: "softmax" or "sigmoid" of the router logits; ``top_k`` experts per token of ``num_experts``,
    each a SwiGLU of width ``expert_hidden``; ``score_bias``: a per-expert bias added to the scores to choose only
    (buffer ``expert_bias``); ``renormalise``: the chosen weights divided by their sum (+ ``renormalise_eps``);
    ``scaling``: the routed scaling factor; ``shared_hidden``: a shared SwiGLU expert's width (None: none), behind
    sigmoid(shared_gate x) if ``shared_gate``. ``expert_kind``: "swiglu" (down(silu(gate x) * up x)) or "relu2"
    (down(relu(up x)^2), no gate); ``shared_kind``: the shared expert's, the same or "packed_swiglu" (gate and up rows
    in one matrix); ``latent``: the routed experts run on latent_in(x) [.., latent] and their sum goes through
    latent_out (Linear, no bias), the router and the shared expert on x; ``groups`` / ``top_groups``: group-limited
    routing (edgelin.ops.moe)."""

    d_model: int
    num_experts: int
    top_k: int
    expert_hidden: int
    scoring: str = "softmax"
    score_bias: bool = False
    renormalise: bool = True
    renormalise_eps: float = 0.0
    scaling: float = 1.0
    shared_hidden: int | None = None
    shared_gate: bool = False
    expert_kind: str = "swiglu"
    shared_kind: str = "swiglu"
    latent: int | None = None
    groups: int = 1
    top_groups: int = 1

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE scoring must be one of {', '.join(SCORINGS)}, got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.expert_kind not in EXPERT_KINDS or self.shared_kind not in SHARED_KINDS:
            raise ValueError(f"MoE expert_kind must be one of {', '.join(EXPERT_KINDS)} and shared_kind one of "
                             f"{', '.join(SHARED_KINDS)}, got {self.expert_kind!r} and {self.shared_kind!r}")
        if self.num_experts % self.groups or not 1 <= self.top_groups <= self.groups:
            raise ValueError(f"MoE groups must divide num_experts ({self.num_experts}) and top_groups be in 1..groups, got "
                             f"{self.groups} and {self.top_groups}")


class MoE(nn.Module):
    """x [B, T, d] -> [B, T, d]: sum of the chosen experts' outputs times their routing weights, plus the shared
    expert's (gated). Modules: ``router`` (Linear d -> E, no bias), ``experts`` (E ``SwiGLU`` or ``ReluSquaredMLP``),
    ``expert_bias`` [E] (a buffer, with ``score_bias``), ``shared`` (of ``shared_kind``) and ``shared_gate`` (Linear
    d -> 1), ``latent_in`` (d -> latent) and ``latent_out`` (latent -> d) where configured.
    ``naive=True`` runs the reference loops (``naive_route``, ``naive_moe``); ``call_modules``: the experts run as
    modules on their routed rows (``module_experts``: edgelin.quantref's hooks on their linears then see those rows)."""

    call_modules = False

    def __init__(self, options: MoEOptions) -> None:
        super().__init__()
        o = self.options = options
        self.router = nn.Linear(o.d_model, o.num_experts, bias=False)
        expert = SimpleNamespace(d_model=o.latent or o.d_model, mlp_hidden=o.expert_hidden)
        self.experts = nn.ModuleList(EXPERT_KINDS[o.expert_kind](expert) for _ in range(o.num_experts))
        if o.score_bias:
            self.register_buffer("expert_bias", torch.zeros(o.num_experts))
        else:
            self.expert_bias = None
        shared = SimpleNamespace(d_model=o.d_model, mlp_hidden=o.shared_hidden)
        self.shared = SHARED_KINDS[o.shared_kind](shared) if o.shared_hidden else None
        self.shared_gate = nn.Linear(o.d_model, 1, bias=False) if o.shared_hidden and o.shared_gate else None
        if o.latent:
            self.latent_in = nn.Linear(o.d_model, o.latent, bias=False)
            self.latent_out = nn.Linear(o.latent, o.d_model, bias=False)

    def routing(self, x: torch.Tensor, *, naive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, d] -> (ids [B T, k], weights [B T, k]): the routing of each token."""
        o = self.options
        rule = naive_route if naive else route
        logits = self.router(x)  # on [B, T, d]: a MatMul in the graphs, as every projection (not a Gemm)
        return rule(logits.reshape(-1, o.num_experts), o.top_k, scoring=o.scoring, bias=self.expert_bias,
                    renormalise=o.renormalise, eps=o.renormalise_eps, scale=o.scaling, groups=o.groups, top_groups=o.top_groups)

    def forward(self, x: torch.Tensor, *, naive: bool = False) -> torch.Tensor:
        ids, weights = self.routing(x, naive=naive)
        flat = x.reshape(-1, x.shape[-1])  # [N, d], N = B T
        if self.options.latent:
            flat = self.latent_in(flat)  # [N, latent]
        y = (naive_moe if naive else module_experts if self.call_modules else moe_experts)(flat, ids, weights, self.experts)
        if self.options.latent:
            y = self.latent_out(y)
        y = y.reshape(x.shape)
        if self.shared is not None:
            s = self.shared(x)
            y = y + (torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s)
        return y


@register_mixer("moe")
class MoEMixer(nn.Module):
    """A block whose "mixer" is a mixture-of-experts MLP: no state, every token on its own (any form, any lengths);
    the naive form runs the reference loops."""

    forms = None
    accepts_lengths = True
    bounded_state = True  # no state at all

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        self.mlp = moe

    def state_layout(self) -> dict[str, tuple]:
        return {}

    def forward(self, x: torch.Tensor, state: State, **run: Any) -> tuple[torch.Tensor, State]:
        return self.mlp(x, naive=run.get("form") == "naive"), {}


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE modules, in module order (a block's MLP or an MoE layer)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


__all__ = ["EXPERT_KINDS", "MoE", "MoEMixer", "MoEOptions", "SHARED_KINDS", "moe_layers"]
