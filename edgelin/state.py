"""The torch side of the state contract: a model's state is a dict ``spec.key -> tensor`` whose layout
``state_specs()`` declares (``edgelin.runtime.manifest.StateSpec``: key, graph IO names, shape with the
"batch" symbol, dtype, init). This module builds fresh states and moves states between torch and numpy,
always pairing tensors by key."""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch

from edgelin.runtime.manifest import BATCH, StateSpec

State = dict[str, torch.Tensor]


def fresh_state(
    specs: Iterable[StateSpec], batch: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> State:
    """Every state tensor at its init value: float states in ``dtype``, int64 states as int64."""
    return {
        s.key: torch.full(
            tuple(batch if d == BATCH else d for d in s.shape), s.init,
            dtype=torch.int64 if s.dtype == "int64" else dtype, device=device,
        )
        for s in specs
    }


def to_numpy(specs: Iterable[StateSpec], state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """torch state (by key) -> arrays by graph input name, in spec order."""
    return {s.input: state[s.key].detach().cpu().numpy() for s in specs}


def from_numpy(specs: Iterable[StateSpec], arrays: Mapping[str, np.ndarray]) -> State:
    """Arrays by graph input name (what ``edgelin.runtime.State.numpy()`` gives) -> torch state by key."""
    return {s.key: torch.from_numpy(np.ascontiguousarray(arrays[s.input])) for s in specs}


__all__ = ["State", "from_numpy", "fresh_state", "to_numpy"]
