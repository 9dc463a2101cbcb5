"""The torch side of the state contract: a model's state is a dict ``spec.key -> tensor`` whose layout
``state_specs()`` declares (``edgelin.runtime.manifest.StateSpec``: key, graph IO names, shape with the
"batch" symbol, dtype, init). This module builds fresh states and moves states between torch and numpy,
always pairing tensors by key."""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np
import torch

from edgelin.parity import rel_max
from edgelin.runtime.manifest import StateSpec

State = dict[str, torch.Tensor]


def fresh_state(
    specs: Iterable[StateSpec], batch: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> State:
    """Every state tensor at its init value: float states in ``dtype``, int64 states as int64; a growing state
    (a KV cache, dim "past") holds no positions yet."""
    return {
        s.key: torch.full(
            s.concrete_shape(batch, past=0), s.init,
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


def state_mismatch(
    got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *, tol: float, float_dtype: torch.dtype | None = None
) -> str:
    """What differs between two torch states, or "": keys (same order), then per key shape and dtype, then
    values: float tensors within relative error max|got - want| / max|want| <= tol (NaN never is), integer
    ones equal. ``float_dtype``: the dtype ``got``'s float tensors must have when ``want`` is a reference
    in another precision (default: ``want``'s own)."""
    if list(got) != list(want):
        return f"keys {list(got)} != {list(want)}"
    for key, w in want.items():
        g = got[key]
        dtype = float_dtype if (float_dtype is not None and w.is_floating_point()) else w.dtype
        if g.shape != w.shape or g.dtype != dtype:
            return f"state {key}: {tuple(g.shape)} {g.dtype} != {tuple(w.shape)} {dtype}"
        if w.is_floating_point():
            err = rel_max(g, w)
            if not err <= tol:
                return f"state {key}: relative error {err:.3g} > {tol:g}"
        elif not torch.equal(g, w):
            return f"state {key}: values differ"
    return ""


__all__ = ["State", "from_numpy", "fresh_state", "state_mismatch", "to_numpy"]
