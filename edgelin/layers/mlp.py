"""MLPs: SwiGLU (packed or not), GeGLU (Gemma's, with biases), Nemotron-H's squared-ReLU MLP, and a layer that is only
an MLP (kind "mlp")."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import register_mixer
from edgelin.state import State


class SwiGLU(nn.Module):
    def __init__(self, cfg: Any) -> None:  # any object with d_model and mlp_hidden
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PackedSwiGLU(nn.Module):
    """SwiGLU with the gate and up projections in one matrix, gate rows first (Granite's ``shared_mlp``)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.input_linear = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.output_linear = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (torch's approximate="tanh",
    transformers' gelu_pytorch_tanh), written out in elementary operators: no Gelu node in the graphs."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x)) with a bias on every projection (RecurrentGemma's MLP)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=True)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=True)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_tanh(self.gate(x)) * self.up(x))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's MLP (``mlp_hidden_act: relu2``, no gate)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)).square())


@register_mixer("mlp")
class MLPMixer(nn.Module):
    """A block whose "mixer" is an MLP (Nemotron-H's "-" layers: RMSNorm -> MLP -> residual): no state, every token
    on its own, so it runs any form, takes any lengths and leaves no state. ``mlp``: the MLP module."""

    forms = None
    accepts_lengths = True
    bounded_state = True  # no state at all

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def state_layout(self) -> dict[str, tuple]:
        return {}

    def forward(self, x: torch.Tensor, state: State, **run: Any) -> tuple[torch.Tensor, State]:
        return self.mlp(x), {}


__all__ = ["GeGLU", "MLPMixer", "PackedSwiGLU", "ReluSquaredMLP", "SwiGLU", "gelu_tanh"]
