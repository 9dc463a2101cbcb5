"""The recurrent state of a batch of sequences, held as OrtValues on the provider's device.

One OrtValue per manifest state spec (``state.{layer}.{name}``), in manifest order. A linear-attention
state has a fixed size whatever the sequence length; a growing state (a KV cache: dim "past" in its spec)
holds ``past`` positions, the same for every growing state and row (rows that saw fewer tokens are
left-padded; the graphs mask padding by each row's position). A session advances a state in place: with IO
binding the graph writes into a second set of buffers (never the ones it reads) and the two sets swap, so on
CPU no array is copied per step; a growing state is re-allocated by ONNX Runtime on every call.

Snapshots are ``.npz`` files holding every state array plus a JSON header with the export's
``source`` hash and the names, shapes and dtypes, so a state is never restored into another model, and the
positions it has seen (a windowed KV cache holds fewer), so a restored sequence keeps to a declared context.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np
import onnxruntime as ort

from edgelin.errors import NonFiniteError, OutputError, RuntimeInputError
from edgelin.runtime.files import atomic_write, check_path, regular_file
from edgelin.runtime.manifest import Manifest
from edgelin.runtime.memory import check_bytes
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
        self.past = _past_of(manifest, self._values)  # positions a growing state holds (0 without one)
        self.seen = self.past  # tokens fed since the fresh state, at least (a context limit is checked against it)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def fresh(cls, manifest: Manifest, batch: int, device: Device = CPU) -> "State":
        """Every state at its spec's ``init`` value: the state before the first token."""
        batch = check_int("batch", batch, low=1)
        check_bytes(manifest.state_bytes(batch), f"a state of {batch:,} sequence(s)", "use a smaller batch")
        arrays = [np.full(s.concrete_shape(batch), s.init, dtype=s.np_dtype) for s in manifest.states]
        return cls(manifest, batch, [to_ortvalue(a, device) for a in arrays], device)

    @classmethod
    def from_arrays(cls, manifest: Manifest, arrays: dict[str, np.ndarray], device: Device = CPU, *, copy: bool = True) -> "State":
        """A state from numpy arrays keyed by state input name; names, shapes and dtypes are checked.

        With ``copy=False`` a CPU state shares the arrays' memory.
        """
        if not isinstance(arrays, dict):
            raise RuntimeInputError(f"state arrays must be a dict of state name -> array, got {type(arrays).__name__}")
        missing = [s.input for s in manifest.states if s.input not in arrays]
        extra = sorted(set(arrays) - {s.input for s in manifest.states})
        if missing or extra:
            raise RuntimeInputError(
                f"state arrays do not match this model: missing {missing or 'none'}, unexpected {extra or 'none'}"
            )
        first = np.shape(arrays[manifest.states[0].input]) if manifest.states else (1,)
        if len(first) == 0 or first[0] < 1:
            raise RuntimeInputError(f"state {manifest.states[0].input!r} has shape {list(first)}; the first dim is the batch (>= 1)")
        batch = int(first[0])
        values = []
        past = None  # set by the first growing state: every other must hold as many positions
        for s in manifest.states:
            try:
                a = np.asarray(arrays[s.input])
            except (ValueError, TypeError) as exc:
                raise RuntimeInputError(f"state {s.input!r} is not an array ({exc})") from None
            past = _array_past(s, a, past if s.grows else None)
            if a.shape != s.concrete_shape(batch, past or 0) or a.dtype != s.np_dtype:
                need = [d if d == "past" else n for d, n in zip(s.shape, s.concrete_shape(batch))]
                raise RuntimeInputError(
                    f"state {s.input!r} is {a.dtype}{list(a.shape)}; this model needs {s.dtype}{need} for batch {batch}"
                    + (f" with past = {past} (as the other growing states)" if s.grows and past is not None else "")
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
        return self.manifest.state_bytes(self.batch, self.past)

    def __repr__(self) -> str:
        past = f", past={self.past}" if self.manifest.grows else ""
        return f"State(batch={self.batch}{past}, arrays={len(self._values)}, bytes={self.nbytes()}, device={self.device[0]})"

    # ---- copies, rows --------------------------------------------------------------------------
    def fork(self) -> "State":
        """An independent copy: advancing one never changes the other (branch a conversation)."""
        return self._carry(State.from_arrays(self.manifest, self.numpy(), self.device, copy=False))

    def _carry(self, other: "State") -> "State":
        """``other`` (made from this state's arrays) with this state's positions seen: a windowed KV cache holds only
        its window, so its arrays alone undercount them and a declared context would be passed."""
        other.seen = max(other.seen, self.seen)
        return other

    def rows(self, index: Sequence[int]) -> "State":
        """A new state holding the sequences ``index`` of this one, in that order."""
        index = list(index)
        bad = [i for i in index if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -self.batch <= i < self.batch]
        if bad or not index:
            raise RuntimeInputError(f"rows takes a non-empty list of indices of this state's {self.batch} sequence(s) (0..{self.batch - 1}), got {index!r}")
        return self._carry(State.from_arrays(self.manifest, {k: a[index] for k, a in self.numpy().items()}, self.device, copy=False))

    def split(self) -> list["State"]:
        """One batch-1 state per sequence."""
        return [self.rows([i]) for i in range(self.batch)]

    @staticmethod
    def stack(states: Sequence["State"]) -> "State":
        """Concatenate states of the same export along the batch dim; growing states (KV caches) of different
        lengths are left-padded to the longest (padding is masked by each row's position, edgelin.layers.attention)."""
        if not isinstance(states, (list, tuple)) and not hasattr(states, "__iter__"):
            raise RuntimeInputError(f"State.stack takes a list of states, got {type(states).__name__}")
        states = list(states)
        if not states:
            raise RuntimeInputError("State.stack takes at least one state, got none")
        for s in states:
            require_state(s)
        first = states[0]
        for s in states[1:]:
            first._check_same_model(s)
        arrays = [s.numpy() for s in states]
        past = max(s.past for s in states)
        out = {}
        for spec in first.manifest.states:
            parts = [a[spec.input] for a in arrays]
            if spec.grows:
                axis = spec.shape.index("past")
                parts = [np.pad(p, [(past - p.shape[axis], 0) if i == axis else (0, 0) for i in range(p.ndim)]) for p in parts]
            out[spec.input] = np.concatenate(parts)
        stacked = State.from_arrays(first.manifest, out, first.device, copy=False)
        stacked.seen = max(s.seen for s in states)
        return stacked

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
            self.past = _past_of(self.manifest, self._values)

    # ---- snapshots -----------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the state to ``path`` (.npz) atomically: a temporary file in the same folder, then rename.

        An existing file is replaced only if it is an edgelin state file (``is_state_file``) and not part of
        an export, or with ``overwrite=True`` (never a folder, a link, a FIFO or a device)."""
        if not isinstance(path, (str, os.PathLike)):
            raise RuntimeInputError(f"State.save takes a file path, got {type(path).__name__}")
        if not os.fspath(path):
            raise RuntimeInputError("State.save takes a file path, got an empty one")
        path = check_path(path, "state file")
        values = self.numpy()
        bad = _nonfinite(self.manifest, values)  # load refuses such a state: do not write one
        if bad:
            raise NonFiniteError(f"{bad}, so it is not saved to {path} -- start a fresh one")
        header = {
            "format": SNAPSHOT_FORMAT, "source": self.manifest.source, "model": self.manifest.model, "batch": self.batch,
            "states": [{"input": s.input, "shape": list(s.concrete_shape(self.batch, self.past)), "dtype": s.dtype} for s in self.manifest.states],
            "seen": self.seen,  # positions fed since the fresh state: more than a windowed KV cache holds
        }
        arrays = {HEADER_KEY: np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8), **values}
        folder = path.parent if str(path.parent) else Path(".")
        if not folder.is_dir():
            raise OutputError(f"cannot write the state to {path}: folder {folder} does not exist")
        atomic_write(path, lambda f: np.savez(f, **arrays), overwrite=overwrite, ours=is_state_file, what="state file")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, manifest: Manifest, device: Device = CPU, *, batch: int | None = None) -> "State":
        """Read a snapshot written by ``save``; refuse one from another model, or of another batch size if
        ``batch`` is given, and one that holds NaN or infinite values."""
        if not isinstance(path, (str, os.PathLike)):
            raise RuntimeInputError(f"a state file is a path, got {type(path).__name__}")
        path = check_path(path, "state file")
        arrays, seen = _read_snapshot(path, manifest, batch)
        bad = _nonfinite(manifest, arrays)
        if bad:
            raise RuntimeInputError(f"{path}: {bad} -- start a fresh one")
        state = cls.from_arrays(manifest, arrays, device, copy=False)
        if seen is not None:
            if seen < state.past:
                raise RuntimeInputError(f"{path} has a malformed header ('seen' is {seen}, fewer than the {state.past} positions it holds); {NOT_A_STATE}")
            state.seen = seen
        return state


def _nonfinite(manifest: Manifest, arrays: dict[str, np.ndarray]) -> str:
    """What is wrong with the first float state of ``arrays`` that holds NaN or infinite values, or ''."""
    for s in manifest.states:
        a = arrays.get(s.input)
        if a is not None and np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            return (f"state {s.input!r} holds {int((~np.isfinite(a)).sum())} NaN/infinite value(s); "
                    "a state that went non-finite cannot be continued")
    return ""


NOT_A_STATE = "pass a file written by --state-out / State.save"
MAX_HEADER_BYTES = 1 << 20
NPY_HEADER_ROOM = 1 << 16  # an .npy member is its array plus a header of at most this many bytes


def is_state_file(path: str | os.PathLike) -> bool:
    """True if ``path`` is a state file edgelin wrote (an .npz whose header says ``edgelin-state/``): the
    content, not the name, tells. Reads only the zip directory and the (bounded) header."""
    try:
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(HEADER_KEY + ".npy")
            if info.file_size > MAX_HEADER_BYTES:
                return False
            with zf.open(info) as f:
                raw = np.lib.format.read_array(f, allow_pickle=False)
        header = json.loads(raw.tobytes().decode("utf-8"))
    except Exception:  # noqa: BLE001 -- anything unreadable is not ours
        return False
    return isinstance(header, dict) and str(header.get("format", "")).startswith("edgelin-state/")


is_state_file.kind = "an edgelin state file (written by --state-out / State.save)"  # type: ignore[attr-defined]


def _read_snapshot(path: Path, manifest: Manifest, batch: int | None) -> tuple[dict[str, np.ndarray], int | None]:
    """The arrays of a snapshot and the positions it had seen (None: a file written before it recorded them), after its header was checked against ``manifest`` and every member's
    size against the state it should hold (a corrupt file never makes numpy allocate more). Only a
    regular file is opened (a FIFO would block), and only one no larger than the memory available."""
    if not isinstance(path, Path):
        raise RuntimeInputError(f"a state file is a path, got {type(path).__name__}")
    regular_file(path, _max_state_file_bytes(), "state file")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except FileNotFoundError:
        raise RuntimeInputError(f"state file {path} does not exist") from None
    except OSError as exc:
        raise RuntimeInputError(f"cannot read state file {path}: {exc.strerror or exc}") from None
    if magic.startswith(b"\x93NUMPY"):
        raise RuntimeInputError(f"{path} is a single .npy array, not an edgelin state file (.npz with a header); {NOT_A_STATE}")
    if not magic.startswith(b"PK"):
        raise RuntimeInputError(f"{path} is not an edgelin state file (not an .npz archive); {NOT_A_STATE}")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = {i.filename: i for i in zf.infolist()}
            head = infos.get(HEADER_KEY + ".npy")
            if head is None:
                raise RuntimeInputError(f"{path} is not an edgelin state file (no header); {NOT_A_STATE}")
            if head.file_size > MAX_HEADER_BYTES:
                raise RuntimeInputError(f"{path} has a {head.file_size:,}-byte header; not an edgelin state file")
            with np.load(path, allow_pickle=False) as npz:
                raw = npz[HEADER_KEY]
                header = _check_header(path, raw, manifest, batch)
                want = {s.input: s.nbytes(header["batch"], _header_past(path, header, s)) for s in manifest.states}
                members = {name[:-4] for name in infos if name.endswith(".npy")} - {HEADER_KEY}
                unknown = sorted(members - set(want))
                if unknown:
                    raise RuntimeInputError(f"{path} holds arrays this model does not have: {', '.join(unknown[:4])}")
                for name in members:
                    if infos[name + ".npy"].file_size > want[name] + NPY_HEADER_ROOM:
                        raise RuntimeInputError(f"{path}: array {name!r} is larger than this model's state; not an edgelin state file")
                return {name: npz[name] for name in members}, header.get("seen")
    except RuntimeInputError:
        raise
    except Exception as exc:  # noqa: BLE001 -- zip, zlib and numpy raise many kinds for a corrupt file
        raise RuntimeInputError(f"{path} is not a readable edgelin state file ({exc.__class__.__name__}); {NOT_A_STATE}") from None


def _max_state_file_bytes() -> int:
    from edgelin.runtime.memory import available_memory

    have = available_memory()
    return have if have is not None else 1 << 48


def _check_header(path: Path, raw: np.ndarray, manifest: Manifest, batch: int | None) -> dict:
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise RuntimeInputError(f"{path} has a malformed header; {NOT_A_STATE}")
    try:
        header = json.loads(raw.tobytes().decode("utf-8"))
    except (ValueError, RecursionError):
        raise RuntimeInputError(f"{path} has a malformed header (not JSON); {NOT_A_STATE}") from None
    if not isinstance(header, dict):
        raise RuntimeInputError(f"{path} has a malformed header (not an object); {NOT_A_STATE}")
    if header.get("format") != SNAPSHOT_FORMAT:
        fmt = header.get("format")
        raise RuntimeInputError(f"{path} has state format {str(fmt)[:40]!r}; this edgelin reads {SNAPSHOT_FORMAT!r}")
    if header.get("source") != manifest.source or header.get("model") != manifest.model:
        what = "weights" if header.get("source") != manifest.source else "config"
        raise RuntimeInputError(
            f"{path} was saved from another model (its {what} differ from this export's); a state only continues the model that made it"
        )
    held = header.get("batch")
    if isinstance(held, bool) or not isinstance(held, int) or held < 1:
        raise RuntimeInputError(f"{path} has a malformed header ('batch' is {str(held)[:40]!r}); {NOT_A_STATE}")
    if batch is not None and held != batch:
        raise RuntimeInputError(f"{path} holds {held} sequence(s) but {batch} are needed here")
    seen = header.get("seen")
    if seen is not None and (isinstance(seen, bool) or not isinstance(seen, int) or seen < 0):
        raise RuntimeInputError(f"{path} has a malformed header ('seen' is {str(seen)[:40]!r}); {NOT_A_STATE}")
    check_bytes(manifest.state_bytes(held), f"the state in {path} ({held:,} sequences)", "it cannot be loaded on this machine")
    return header


def _array_past(spec, array: np.ndarray, past: int | None) -> int | None:
    """The positions ``array`` holds for growing state ``spec`` (``past`` if an earlier one set it), checked
    against the spec's window; None for a fixed-size state."""
    if not spec.grows:
        return past
    axis = spec.shape.index("past")
    if array.ndim != len(spec.shape):
        return past if past is not None else 0  # the shape check names the problem
    held = int(array.shape[axis])
    if past is not None and held != past:
        raise RuntimeInputError(f"state {spec.input!r} holds {held} positions but the other growing states hold {past}; they must agree")
    if spec.window is not None and held > spec.window:
        raise RuntimeInputError(f"state {spec.input!r} holds {held} positions; its window keeps at most {spec.window}")
    return held


def _past_of(manifest: Manifest, values: Sequence[ort.OrtValue]) -> int:
    for spec, v in zip(manifest.states, values):
        if spec.grows:
            return int(v.shape()[spec.shape.index("past")])
    return 0


def _header_past(path: Path, header: dict, spec) -> int:
    """The positions a snapshot says growing state ``spec`` holds (0 for a fixed-size state), bounded by its window."""
    if not spec.grows:
        return 0
    entry = next((e for e in header.get("states", []) if isinstance(e, dict) and e.get("input") == spec.input), None)
    shape = entry.get("shape") if entry else None
    axis = spec.shape.index("past")
    if not isinstance(shape, list) or len(shape) != len(spec.shape) or not isinstance(shape[axis], int) or shape[axis] < 0:
        raise RuntimeInputError(f"{path} has a malformed header (no shape for {spec.input!r}); {NOT_A_STATE}")
    held = shape[axis]
    if spec.window is not None and held > spec.window:
        raise RuntimeInputError(f"{path}: state {spec.input!r} holds {held} positions; its window keeps at most {spec.window}")
    return held


def require_state(state: object) -> None:
    """RuntimeInputError unless ``state`` is a State."""
    if not isinstance(state, State):
        raise RuntimeInputError(f"state must be a State (from Session.new_state), got {type(state).__name__}")


def check_state_for(state: object, prompts: int) -> None:
    """RuntimeInputError unless ``state`` is a State of ``prompts`` sequences (one per prompt)."""
    require_state(state)
    if state.batch != prompts:
        raise RuntimeInputError(f"the state holds {state.batch} sequence(s) but there are {prompts} prompt(s); create it with new_state({prompts})")


__all__ = ["CPU", "SNAPSHOT_FORMAT", "State", "is_state_file", "check_state_for", "require_state", "to_ortvalue"]
