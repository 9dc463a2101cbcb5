"""The two graphs as torch modules with flat tensor IO: ``forward(input_ids, *states) -> (logits, *states)``.

IO names come from one place (``io_names``) so the prefill graph, the decode graph and the manifest
cannot disagree: state input ``state.{layer}.{name}``, state output ``present.{layer}.{name}``.
"""

from __future__ import annotations

import torch
from torch import nn

from edgelin.model import LinearLM

INPUT_IDS = "input_ids"
LOGITS = "logits"


def io_names(model: LinearLM) -> tuple[list[str], list[str], list[str]]:
    """(state keys "{layer}.{name}", graph input names, graph output names), in graph order."""
    keys = list(model.state_layout())
    inputs = [INPUT_IDS] + [f"state.{key}" for key in keys]
    outputs = [LOGITS] + [f"present.{key}" for key in keys]
    return keys, inputs, outputs


class _Graph(nn.Module):
    def __init__(self, model: LinearLM) -> None:
        super().__init__()
        self.model = model
        self.keys = io_names(model)[0]

    def _run(self, input_ids: torch.Tensor, state: dict[str, torch.Tensor]):
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, new = self._run(input_ids, dict(zip(self.keys, states)))
        return (logits, *(new[key] for key in self.keys))


class PrefillGraph(_Graph):
    """input_ids [batch, sequence] + states -> logits [batch, sequence, vocab] + final states (chunked form)."""

    def _run(self, input_ids, state):
        return self.model(input_ids, state)


class DecodeGraph(_Graph):
    """input_ids [batch, 1] + states -> logits [batch, 1, vocab] + next states (recurrent step only)."""

    def _run(self, input_ids, state):
        return self.model.step(input_ids, state)
