"""The state contract: a state's key from (layer, name), its graph input and output names, and ``StateSpec``, the
one description of a state tensor that the model, the exporter, the manifest and every runtime share. Standard
library + numpy only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgelin.errors import ManifestError
from edgelin.runtime.manifest.format import BATCH, DTYPES, MAX_DIM, PAST, PRESENT_PREFIX, STATE_PREFIX
from edgelin.runtime.manifest.strict import dim_ok, fits, kind_of, name_ok, short


def state_key(layer: int, name: str) -> str:
    """The one place a (layer index, state name) pair becomes a state key, e.g. (0, "S") -> "0.S"."""
    return f"{layer}.{name}"


def state_io_names(key: str) -> tuple[str, str]:
    """The one place a state key ("{layer}.{name}", e.g. "0.S") becomes its graph input and output names."""
    return f"{STATE_PREFIX}{key}", f"{PRESENT_PREFIX}{key}"


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state tensor: the state contract shared by the model (``state_specs()``), the
    exporter, the manifest and every runtime. Consumers pair tensors by ``key``, never by position."""

    input: str  # graph input name, e.g. "state.0.S"
    output: str  # graph output name, e.g. "present.0.S"
    shape: tuple  # ints and symbolic dims (strings): e.g. ("batch", 4, 64, 64)
    dtype: str  # a key of DTYPES
    init: float | int  # value of a fresh sequence's state
    window: int | None = None  # a growing state only: the most positions it keeps (None: all)

    @classmethod
    def for_key(cls, key: str, shape: tuple, dtype: str = "float32", init: float | int = 0.0, window: int | None = None) -> "StateSpec":
        """The spec of state ``key`` ("{layer}.{name}"); IO names from ``state_io_names``."""
        if dtype not in DTYPES:
            raise ManifestError(f"state {key!r} has dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        if not shape or shape[0] != BATCH or not all((isinstance(d, int) and d > 0) or d == PAST for d in shape[1:]):
            raise ManifestError(f"state {key!r} has shape {shape!r}; expected ({BATCH!r}, positive ints or {PAST!r}...)")
        if window is not None and (PAST not in shape or isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ManifestError(f"state {key!r}: a window (positive int) belongs to a growing state (shape with {PAST!r}), got {window!r}")
        return cls(*state_io_names(key), tuple(shape), dtype, init, window)

    @property
    def key(self) -> str:
        """"{layer}.{name}", e.g. "0.S": the key of this tensor in a model's state dict."""
        return self.input[len(STATE_PREFIX):] if self.input.startswith(STATE_PREFIX) else self.input

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def grows(self) -> bool:
        """True for a state that grows along the sequence (a KV cache): its shape has the "past" dim."""
        return PAST in self.shape

    def concrete_shape(self, batch: int, past: int = 0) -> tuple[int, ...]:
        """The shape for ``batch`` sequences holding ``past`` positions (a growing state; 0: a fresh one)."""
        return tuple(batch if d == BATCH else past if d == PAST else int(d) for d in self.shape)

    def nbytes(self, batch: int = 1, past: int = 0) -> int:
        return math.prod(self.concrete_shape(batch, past)) * self.np_dtype.itemsize  # exact: no int64 overflow

    def to_dict(self) -> dict[str, Any]:
        d = {"input": self.input, "output": self.output, "shape": list(self.shape), "dtype": self.dtype, "init": self.init}
        return d if self.window is None else {**d, "window": self.window}

    def present_length(self, past: int, tokens: int) -> int:
        """Positions a growing state holds after a call of ``tokens`` tokens from ``past``."""
        n = past + tokens
        return n if self.window is None else min(n, self.window)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "StateSpec":
        if not isinstance(d, dict):
            raise ManifestError(f"{where} must be an object, got {kind_of(d)}")
        for key in ("input", "output", "shape", "dtype", "init"):
            if key not in d:
                raise ManifestError(f"{where} has no {key!r}")
        for key in ("input", "output"):
            if not name_ok(d[key]):
                raise ManifestError(f"{where}: {key!r} must be a non-empty name (text), got {short(d[key])}")
        if not isinstance(d["dtype"], str) or d["dtype"] not in DTYPES:
            raise ManifestError(f"{where} has dtype {short(d['dtype'])}; supported: {', '.join(DTYPES)}")
        shape = d["shape"]
        if not isinstance(shape, list) or not shape or not all(dim_ok(s) for s in shape):
            raise ManifestError(
                f"{where} has shape {short(shape)}; expected a list of positive integers (at most {MAX_DIM:,}) after {BATCH!r}"
            )
        if shape[0] != BATCH:
            raise ManifestError(f"{where} has shape {short(shape)}; the first dim must be {BATCH!r}")
        if any(isinstance(s, str) and s != PAST for s in shape[1:]):
            raise ManifestError(f"{where} has shape {short(shape)}; only the batch dim and {PAST!r} may be symbolic")
        init = d["init"]
        if d["dtype"] == "int64":
            if isinstance(init, bool) or not isinstance(init, int) or not -(2**63) <= init < 2**63:
                raise ManifestError(f"{where}: 'init' must be an int64 integer for an int64 state, got {short(init)}")
        elif isinstance(init, bool) or not isinstance(init, (int, float)) or not math.isfinite(init):
            raise ManifestError(f"{where}: 'init' must be a finite number, got {short(init)}")
        elif not fits(init, d["dtype"]):
            raise ManifestError(f"{where}: 'init' {init!r} does not fit in {d['dtype']}")
        window = d.get("window")
        if window is not None and (PAST not in shape or not dim_ok(window) or isinstance(window, str)):
            raise ManifestError(f"{where}: 'window' must be a positive integer on a state whose shape has {PAST!r}, got {short(window)}")
        if shape.count(PAST) > 1:
            raise ManifestError(f"{where} has shape {short(shape)}; {PAST!r} may appear once")
        return cls(d["input"], d["output"], tuple(shape), d["dtype"], init, window)
