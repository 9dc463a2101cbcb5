"""Mixers side by side on the same input: the skeleton's mixer kind "parallel" (Falcon-H1's hybrid layer, where
softmax attention and Mamba2 both read the block's normalised input and their outputs are summed).

    y = sum over members m of  scale_m * m(x)          x [B, T, d] -> y [B, T, d]

Each member is any registered mixer kind and keeps its own math in every form; a scale of 1 adds nothing to the
graphs (an importer folds a member's multipliers into its weights where that is exact and passes 1).

State: the union of the members' states, each member's names prefixed by its member name and a dot ("mamba.S",
"attention.key"), in member order and then each member's layout order. A member reads and returns its own state
under its own names: the state handling stays the member's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.state import State

SEPARATOR = "."  # between a member's name and its state's name


@register_mixer("parallel")
class Parallel(nn.Module):
    """Several mixers on the same input, their outputs summed, each times its scale (module docstring).
    ``members``: member name -> mixer (names without a dot, in the order their states are laid out);
    ``scales``: member name -> the factor on its output (1 where absent)."""

    def __init__(self, members: dict[str, nn.Module], scales: dict[str, float] | None = None) -> None:
        super().__init__()
        if not members:
            raise ValueError("a parallel layer needs at least one member mixer")
        bad = [name for name in members if not name or SEPARATOR in name]
        if bad:
            raise ValueError(f"member names must be non-empty and without {SEPARATOR!r}, got {bad[0]!r}")
        unknown = sorted(set(scales or {}) - set(members))
        if unknown:
            raise ValueError(f"a scale is given for {unknown[0]!r}, which is not a member ({', '.join(members)})")
        self.members = nn.ModuleDict(members)
        self.scales = {name: float((scales or {}).get(name, 1.0)) for name in members}

    @property
    def forms(self) -> tuple[str, ...] | None:
        """The forms every member runs (None: any form, as every member's)."""
        kinds = [set(forms) for m in self.members.values() if (forms := getattr(m, "forms", ("chunk", "step"))) is not None]
        return tuple(sorted(set.intersection(*kinds))) if kinds else None

    @property
    def accepts_lengths(self) -> bool:
        return all(getattr(m, "accepts_lengths", False) for m in self.members.values())

    @property
    def bounded_state(self) -> bool:
        return all(getattr(m, "bounded_state", False) for m in self.members.values())

    @property
    def reads_embeddings(self) -> bool:
        return any(getattr(m, "reads_embeddings", False) for m in self.members.values())

    def state_layout(self) -> dict[str, tuple]:
        return {
            f"{member}{SEPARATOR}{name}": entry
            for member, mixer in self.members.items()
            for name, entry in mixer.state_layout().items()
        }

    def forward(self, x: torch.Tensor, state: State, **run: Any) -> tuple[torch.Tensor, State]:
        """x [B, T, d], the union state -> (the scaled sum of the members' outputs [B, T, d], the new union state)."""
        check_form(self, run.get("form", "chunk"), run.get("lengths"))
        embeddings = run.pop("embeddings", None)
        y: torch.Tensor | None = None
        new: State = {}
        for member, mixer in self.members.items():
            prefix = member + SEPARATOR
            own = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
            extra = {"embeddings": embeddings} if getattr(mixer, "reads_embeddings", False) else {}
            h, out = mixer(x, own, **run, **extra)
            if self.scales[member] != 1.0:
                h = h * self.scales[member]
            y = h if y is None else y + h
            new.update({prefix + name: value for name, value in out.items()})
        return y, new


__all__ = ["Parallel", "SEPARATOR"]
