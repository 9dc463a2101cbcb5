"""Matching a foreign checkpoint's tensors to a model's parameters, by name, with every mismatch named.

A ``Renamer`` maps a checkpoint name to the model's name by replacing name fragments (the first pair whose
fragment occurs wins; a name no pair touches is kept). Several checkpoint names may map to one model tensor
(tied weights saved under either name, or both): each copy present must be equal, and one is enough.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from edgelin import streaming
from edgelin.errors import CheckpointError

WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class RowSplit:
    """A checkpoint tensor whose rows hold several tensors in a layout of its own (transformers' Qwen3-Next packs
    q, k, v and the gate of each key-head group into one ``in_proj_qkvz``): every checkpoint tensor whose name ends
    with ``suffix`` is read as the tensors ``parts`` names, part ``(new_suffix, rows)`` taking the fused tensor's
    rows ``rows`` in that order. The parts then match the model by name like any other tensor."""

    suffix: str
    parts: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def rows(self) -> int:
        return sum(len(rows) for _, rows in self.parts)

    def names(self, name: str) -> list[str]:
        return [name[: -len(self.suffix)] + new for new, _ in self.parts]

    def shapes(self, name: str, shape: tuple[int, ...], where) -> dict[str, tuple[int, ...]]:
        if not shape or shape[0] != self.rows:
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(shape)}, the config expects {self.rows} rows")
        return {part: (len(rows), *shape[1:]) for part, (_, rows) in zip(self.names(name), self.parts)}

    def split(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {part: tensor[list(rows)] for part, (_, rows) in zip(self.names(name), self.parts)}


@dataclass(frozen=True)
class RowJoin:
    """Checkpoint tensors that the framework concatenates along rows when it loads them (transformers' OLMo-hybrid
    stores its one conv over [q | k | v] as ``q_conv1d``, ``k_conv1d``, ``v_conv1d``, and re-saves it in three
    row-chunks of equal size whatever the q, k and v widths): for every checkpoint tensor whose name ends with
    ``parts[0]``, the tensors of the same prefix ending with each of ``parts`` are read as one tensor, prefix +
    ``suffix``, their rows in the order of ``parts``. The joined tensor is then matched, or split (``RowSplit``),
    like any other."""

    parts: tuple[str, ...]
    suffix: str


@dataclass(frozen=True)
class ExpertSplit:
    """A mixture-of-experts checkpoint tensor holding every expert's weight in one [E, rows, cols] tensor (transformers'
    in-memory layout, ``experts.gate_up_proj`` [E, 2I, D] and ``experts.down_proj`` [E, D, I]): every checkpoint tensor
    whose name ends with ``suffix`` is read as expert e's tensors, f"{module}.{e}." + each of ``parts`` (``module``: the
    name up to its last dot), taking equal consecutive row blocks of [rows, cols] in that order (gate rows first, then
    up), for the ``experts`` experts the config says. The parts then match the model by name like any other tensor
    (the per-expert names transformers' save_pretrained writes)."""

    suffix: str
    parts: tuple[str, ...]
    experts: int

    def names(self, name: str) -> list[str]:
        prefix = name.rsplit(".", 1)[0]  # the experts' module: "model.layers.1.mlp.experts"
        return [f"{prefix}.{e}.{part}" for e in range(self.experts) for part in self.parts]

    def shapes(self, name: str, shape: tuple[int, ...], where) -> dict[str, tuple[int, ...]]:
        if len(shape) != 3 or shape[0] != self.experts or shape[1] % len(self.parts):
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(shape)}; the config expects [{self.experts} experts, "
                                  f"rows in {len(self.parts)} equal parts, columns]")
        return {part: (shape[1] // len(self.parts), shape[2]) for part in self.names(name)}

    def split(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        pieces = [block.contiguous() for expert in tensor for block in expert.chunk(len(self.parts), dim=0)]
        return dict(zip(self.names(name), pieces))


def _split_for(name: str, splits: tuple[RowSplit, ...]) -> RowSplit | None:
    return next((s for s in splits if name.endswith(s.suffix)), None)



class Renamer:
    """Checkpoint name <-> model name through (checkpoint part, model part) pairs, applied in order, each at most
    once: a prefix ("model.layers.", "blocks."), a fragment (".mlp.gate_proj.", ".mlp.gate."; starts with a dot),
    or a whole name such as ("lm_head.weight", "embed.weight"), which makes an alias of a tied tensor."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self.pairs = list(pairs)

    @staticmethod
    def _apply(name: str, old: str, new: str) -> str:
        if name == old:
            return new
        if old.startswith("."):
            return name.replace(old, new, 1) if old in name else name
        if old.endswith(".") and name.startswith(old):
            return new + name[len(old):]
        return name

    def __call__(self, checkpoint_name: str) -> str:
        name = checkpoint_name
        for old, new in self.pairs:
            name = self._apply(name, old, new)
        return name

    def inverse(self, model_name: str) -> str:
        name = model_name
        for old, new in reversed(self.pairs):
            name = self._apply(name, new, old)
        return name


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def match(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], rename: Renamer, where: Path) -> dict[str, list[str]]:
    """Model name -> the checkpoint names that hold it, from shapes alone (a safetensors header is enough).
    CheckpointError naming the tensor if one is unexpected, missing or misshaped."""
    groups: dict[str, list[str]] = {}
    unexpected = []
    for name in sorted(found):
        target = rename(name)
        if target in expected:
            groups.setdefault(target, []).append(name)
        else:
            unexpected.append(name)
    if unexpected:
        raise CheckpointError(f"{where}: unexpected tensor(s) {_names(unexpected)}; the config does not describe them")
    missing = [name for name in expected if name not in groups]
    if missing:
        raise CheckpointError(f"{where}: missing tensor(s) {_names(sorted(rename.inverse(n) for n in missing))}")
    for target, sources in groups.items():
        for source in sources:
            if tuple(found[source]) != tuple(expected[target]):
                raise CheckpointError(f"{where}: tensor {source} has shape {tuple(found[source])}, the config expects {tuple(expected[target])}")
    return groups


def load_weights(model: nn.Module, read: Callable[[str], torch.Tensor], groups: dict[str, list[str]], where: Path) -> None:
    """Copy the checkpoint's tensors into ``model`` as float32 along ``groups`` (from ``match``), one tensor at a
    time: ``read(checkpoint name)`` gives it, and it is let go once copied, so that loading holds the model and
    one tensor, not the model and the whole checkpoint. CheckpointError if a tensor is not floating point or
    tied copies differ."""
    targets = model.state_dict(keep_vars=False)  # tensors sharing the parameters' and buffers' storage
    for target, first in checked_tensors(read, groups, where):
        with torch.no_grad():
            targets[target].copy_(first.to(torch.float32))
        del first


def checked_tensors(read: Callable[[str], torch.Tensor], groups: dict[str, list[str]], where: Path):
    """(model name, checkpoint tensor) along ``groups``, one at a time, each checked as ``load_weights`` says."""
    for target, sources in groups.items():
        first = read(sources[0])
        if not first.is_floating_point():
            raise CheckpointError(f"{where}: tensor {sources[0]} has dtype {first.dtype}, expected a floating-point tensor")
        for source in sources[1:]:
            if not torch.equal(first.to(torch.float32), read(source).to(torch.float32)):
                raise CheckpointError(f"{where}: tied tensors {sources[0]} and {source} differ; the config ties them")
        yield target, first
        del first


def load_checkpoint_weights(
    path, build, rename: Renamer, *, left_out: tuple[str, ...] = (), splits: tuple[RowSplit, ...] = (),
    joins: tuple[RowJoin, ...] = (),
) -> nn.Module:
    """``build()``'s model with the weights of checkpoint ``path`` (a folder, or an ``edgelin.checkpoint.Checkpoint``
    whose files are already listed) loaded into it along ``rename`` (eval mode, float32):
    ``model.safetensors``, or the shards a ``model.safetensors.index.json`` names.

    Names and shapes first, from ``build`` on the meta device and the files' headers: a config that disagrees with
    the weights is refused, naming the tensor, before memory is spent on either. Checkpoint tensors whose names
    start with a ``left_out`` prefix (a vision tower, a multi-token-prediction head) are not part of the model:
    they are neither matched nor read. ``splits``: fused checkpoint tensors read as the tensors their rows hold
    (``RowSplit``, or ``ExpertSplit`` for stacked experts); the fused tensor's row count is checked from the header, its parts are matched by name.
    ``joins``: checkpoint tensors read as one, their rows concatenated (``RowJoin``), before any split."""
    from edgelin.importers.folder import Checkpoint, weight_files
    from edgelin.safety import expected_shapes, header_shapes

    if isinstance(path, Checkpoint) and path.config_only:  # the architecture alone: weights as initialised
        return build().eval()

    files = list(path.files) if isinstance(path, Checkpoint) else weight_files(path)
    scratch = streaming.active()  # inside edgelin.streaming.mapped_weights: parameters mapped from a scratch file
    if scratch is not None:  # headers and tensors read without mapping the files (edgelin.streaming.SafetensorsReader)
        header_shapes = streaming.header_shapes
    path = Path(path)
    found: dict[str, tuple[int, ...]] = {}
    home: dict[str, Path] = {}
    for file in files:
        for name, shape in header_shapes(file).items():
            if name in home:
                raise CheckpointError(f"{path}: tensor {name} is in both {home[name].name} and {file.name}")
            if not name.startswith(left_out) or not left_out:
                found[name], home[name] = shape, file
    where = files[0] if len(files) == 1 else path
    joined = _join_shapes(found, joins, where)  # joined name -> the checkpoint names whose rows it holds
    fused = {n: s for n in found if (s := _split_for(n, splits)) is not None}  # checkpoint name -> its RowSplit
    for name, split in fused.items():
        parts = split.shapes(name, found.pop(name), where)
        twice = sorted(set(parts) & set(found))
        if twice:
            raise CheckpointError(f"{where}: tensor {twice[0]} is held twice: on its own and in the rows of {name}")
        found.update(parts)
    groups = match(expected_shapes(build), found, rename, where)
    model = build() if scratch is None else streaming.build_mapped(build)
    with contextlib.ExitStack() as stack:
        handles = {file: _open_safetensors(file, stack, plain=scratch is not None) for file in files}
        pending: dict[str, torch.Tensor] = {}  # the parts of a fused tensor read, not yet copied

        def stored(name: str) -> torch.Tensor:
            if name in joined:
                return torch.cat([_get(handles[home[n]], n, home[n]) for n in joined[name]], dim=0)
            return _get(handles[home[name]], name, home[name])

        def read(name: str) -> torch.Tensor:
            if name in pending:
                return pending.pop(name)
            if name in home or name in joined:
                return stored(name)
            fused_name = next(n for n, split in fused.items() if name in split.names(n))
            pending.update(fused[fused_name].split(fused_name, stored(fused_name)))
            return pending.pop(name)

        if scratch is None:
            load_weights(model, read, groups, where)
        else:
            streaming.map_parameters(model, checked_tensors(read, groups, where), scratch)
            unread = streaming.meta_parameters(model)
            if unread:
                raise CheckpointError(f"{where}: no tensor holds parameter(s) {_names(unread)}; the weights loader cannot map them")
    return model.eval()


def _join_shapes(found: dict[str, tuple[int, ...]], joins: tuple[RowJoin, ...], where) -> dict[str, list[str]]:
    """Replace in ``found`` (checkpoint name -> shape) each group of tensors a ``RowJoin`` reads as one by the joined
    name and shape; returns joined name -> the names of its parts, in row order. CheckpointError naming a part that
    is missing or whose trailing shape differs."""
    joined: dict[str, list[str]] = {}
    for join in joins:
        for first in [n for n in found if n.endswith(join.parts[0])]:
            prefix = first[: -len(join.parts[0])]
            names, target = [prefix + part for part in join.parts], prefix + join.suffix
            missing = [n for n in names if n not in found]
            if missing:
                raise CheckpointError(f"{where}: tensor {missing[0]} is missing; its rows follow those of {first}")
            if target in found:
                raise CheckpointError(f"{where}: tensor {target} is held twice: on its own and in the rows of {', '.join(names)}")
            shapes = [tuple(found.pop(n)) for n in names]
            odd = next((n for n, shape in zip(names, shapes) if len(shape) != len(shapes[0]) or shape[1:] != shapes[0][1:]), None)
            if odd is not None:
                raise CheckpointError(f"{where}: tensor {odd} has shape {shapes[names.index(odd)]}, its rows cannot follow "
                                      f"{first}'s {shapes[0]}")
            found[target] = (sum(shape[0] for shape in shapes), *shapes[0][1:])
            joined[target] = names
    return joined


def _open_safetensors(file: Path, stack: contextlib.ExitStack, plain: bool = False):
    """safetensors' reader, or with ``plain`` edgelin's (``streaming.SafetensorsReader``: no mapping of the file)."""
    from safetensors import SafetensorError, safe_open

    try:
        if plain:
            return stack.enter_context(streaming.SafetensorsReader(file))
        return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc})") from None


def _get(handle, name: str, file: Path) -> torch.Tensor:
    from safetensors import SafetensorError

    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file ({exc})") from None


__all__ = ["ExpertSplit", "Renamer", "RowJoin", "RowSplit", "WEIGHTS_FILE", "load_checkpoint_weights", "load_weights", "match"]
