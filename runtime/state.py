"""The recurrent state of a batch of sequences, held as OrtValues on the provider's device.

One OrtValue per manifest state spec (``state.{layer}.{name}``), in manifest order. The state has a
fixed size whatever the sequence length. A session advances it in place: with IO binding the graph
writes into a second set of buffers (never the ones it reads) and the two sets swap, so on CPU no
array is copied per step.

Snapshots are ``.npz`` files holding every state array plus a JSON header with the export's
``source`` hash and the names, shapes and dtypes, so a state is never restored into another model.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from edgelin.errors import RuntimeInputError
from edgelin.runtime.files import atomic_write
from edgelin.runtime.manifest import Manifest
from edgelin.runtime.options import check_int

SNAPSHOT_FORMAT = "edgelin-state/1"
HEADER_KEY = "__edgelin_state__"

Device = tuple[str, int]  # ("cpu", 0) or ("cuda", device_id)
CPU: Device = ("cpu", 0)


def to_ortvalue(array: np.ndarray, device: Device) -> ort.OrtValue:
    """A numpy array as an OrtValue on ``device``; on CPU the OrtValue shares the array's memory."""
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device[0], device[1])


class State:
    """The state of ``batch`` sequences for one export. Create with ``Session.new_state(batch)``."""

    def __init__(self, manifest: Manifest, batch: int, values: Sequence[ort.OrtValue], device: Device = CPU) -> None:
        self.manifest = manifest
        self.batch = batch
        self.device = device
        self._values = list(values)  # one OrtValue per manifest.states entry
        self._spare: list[ort.OrtValue] | None = None  # output buffers of the next IO-bound run
        self._parity = 0  # which of the two buffer sets is current
        self._bindings: dict = {}  # IO bindings a session made for these buffers, reused step after step

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def fresh(cls, manifest: Manifest, batch: int, device: Device = CPU) -> "State":
        """Every state at its spec's ``init`` value: the state before the first token."""
        batch = check_int("batch", batch, low=1)
        arrays = [np.full(s.concrete_shape(batch), s.init, dtype=s.np_dtype) for s in manifest.states]
        return cls(manifest, batch, [to_ortvalue(a, device) for a in arrays], device)

    @classmethod
    def from_arrays(cls, manifest: Manifest, arrays: dict[str, np.ndarray], device: Device = CPU, *, copy: bool = True) -> "State":
        """A state from numpy arrays keyed by state input name; names, shapes and dtypes are checked.

        With ``copy=False`` a CPU state shares the arrays' memory.
        """
        missing = [s.input for s in manifest.states if s.input not in arrays]
        extra = sorted(set(arrays) - {s.input for s in manifest.states})
        if missing or extra:
            raise RuntimeInputError(
                f"state arrays do not match this model: missing {missing or 'none'}, unexpected {extra or 'none'}"
            )
        batch = int(np.shape(arrays[manifest.states[0].input])[0]) if manifest.states else 1
        values = []
        for s in manifest.states:
            a = np.asarray(arrays[s.input])
            if a.shape != s.concrete_shape(batch) or a.dtype != s.np_dtype:
                raise RuntimeInputError(
                    f"state {s.input!r} is {a.dtype}{list(a.shape)}; this model needs "
                    f"{s.dtype}{list(s.concrete_shape(batch))} for batch {batch}"
                )
            values.append(to_ortvalue(a.copy() if copy else a, device))
        return cls(manifest, batch, values, device)

    # ---- reading -------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [s.input for s in self.manifest.states]

    @property
    def values(self) -> list[ort.OrtValue]:
        """The current OrtValues (manifest order); valid until the state is next advanced."""
        return self._values

    def numpy(self) -> dict[str, np.ndarray]:
        """A copy of every state array, keyed by state input name."""
        return {s.input: np.array(v.numpy(), copy=True) for s, v in zip(self.manifest.states, self._values)}

    def nbytes(self) -> int:
        return self.manifest.state_bytes(self.batch)

    def __repr__(self) -> str:
        return f"State(batch={self.batch}, arrays={len(self._values)}, bytes={self.nbytes()}, device={self.device[0]})"

    # ---- copies, rows --------------------------------------------------------------------------
    def fork(self) -> "State":
        """An independent copy: advancing one never changes the other (branch a conversation)."""
        return State.from_arrays(self.manifest, self.numpy(), self.device, copy=False)

    def rows(self, index: Sequence[int]) -> "State":
        """A new state holding the sequences ``index`` of this one, in that order."""
        index = list(index)
        return State.from_arrays(self.manifest, {k: a[index] for k, a in self.numpy().items()}, self.device, copy=False)

    def split(self) -> list["State"]:
        """One batch-1 state per sequence."""
        return [self.rows([i]) for i in range(self.batch)]

    @staticmethod
    def stack(states: Sequence["State"]) -> "State":
        """Concatenate states of the same export along the batch dim."""
        first = states[0]
        for s in states[1:]:
            first._check_same_model(s)
        arrays = [s.numpy() for s in states]
        return State.from_arrays(first.manifest, {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}, first.device, copy=False)

    def same_model(self, manifest: Manifest) -> bool:
        """True if this state belongs to the model ``manifest`` describes (same weights, config and state layout)."""
        m = self.manifest
        return m is manifest or (m.source, m.model, m.states) == (manifest.source, manifest.model, manifest.states)

    def _check_same_model(self, other: "State") -> None:
        if not self.same_model(other.manifest):
            raise RuntimeInputError("these states belong to different models; only states of one export can be combined")

    # ---- used by Session -----------------------------------------------------------------------
    def _outputs(self) -> list[ort.OrtValue]:
        """Buffers for the next run's state outputs (allocated once, then reused)."""
        if self._spare is None:
            self._spare = [
                ort.OrtValue.ortvalue_from_shape_and_type(s.concrete_shape(self.batch), s.np_dtype, *self.device)
                for s in self.manifest.states
            ]
        return self._spare

    def _advance(self, new_values: list[ort.OrtValue] | None = None) -> None:
        """Make the outputs of the run that just finished the current state (swap the two buffer sets)."""
        if new_values is None:  # IO binding wrote into the spare buffers
            self._values, self._spare = self._spare, self._values
            self._parity ^= 1
        else:  # plain run: fresh arrays; the old buffers (and bindings to them) are dropped
            self._values, self._spare, self._parity, self._bindings = list(new_values), None, 0, {}

    # ---- snapshots -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the state to ``path`` (.npz) atomically: a temporary file in the same folder, then rename."""
        path = Path(path)
        header = {
            "format": SNAPSHOT_FORMAT, "source": self.manifest.source, "model": self.manifest.model, "batch": self.batch,
            "states": [{"input": s.input, "shape": list(s.concrete_shape(self.batch)), "dtype": s.dtype} for s in self.manifest.states],
        }
        arrays = {HEADER_KEY: np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8), **self.numpy()}
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir():
            raise RuntimeInputError(f"cannot write the state to {path}: folder {folder} does not exist")
        atomic_write(path, lambda f: np.savez(f, **arrays))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, manifest: Manifest, device: Device = CPU, *, batch: int | None = None) -> "State":
        """Read a snapshot written by ``save``; refuse one from another model, or of another batch size if ``batch`` is given."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
        except FileNotFoundError:
            raise RuntimeInputError(f"state file {path} does not exist") from None
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            raise RuntimeInputError(f"{path} is not an edgelin state file ({exc.__class__.__name__}); pass a file written by --state-out / State.save") from None
        try:
            header = json.loads(arrays.pop(HEADER_KEY).tobytes().decode("utf-8"))
        except (KeyError, ValueError):
            raise RuntimeInputError(f"{path} is not an edgelin state file (no header); pass a file written by --state-out / State.save") from None
        if header.get("format") != SNAPSHOT_FORMAT:
            raise RuntimeInputError(f"{path} has state format {header.get('format')!r}; this edgelin reads {SNAPSHOT_FORMAT!r}")
        if header.get("source") != manifest.source or header.get("model") != manifest.model:
            what = "weights" if header.get("source") != manifest.source else "config"
            raise RuntimeInputError(
                f"{path} was saved from another model (its {what} differ from this export's); a state only continues the model that made it"
            )
        if batch is not None and header.get("batch") != batch:
            raise RuntimeInputError(f"{path} holds {header.get('batch')} sequence(s) but {batch} are needed here")
        return cls.from_arrays(manifest, arrays, device, copy=False)


__all__ = ["CPU", "SNAPSHOT_FORMAT", "State", "to_ortvalue"]
