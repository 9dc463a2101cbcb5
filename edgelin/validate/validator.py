"""The state a validation carries from check to check (``Validator``) and the small helpers every group uses to
compare logits and say what it found."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edgelin import layerwise, parity, protocol, quantref, upstream as up
from edgelin.layers.moe import moe_layers
from edgelin.parity import BUDGETS
from edgelin.runtime.manifest import Manifest
from edgelin.state import fresh_state
from edgelin.validate.report import KIND_OF, PRECISION_KINDS, Check

Progress = Callable[[str], None]


def errors_or_inf(got: np.ndarray, ref: np.ndarray) -> parity.Errors:
    e = parity.errors(got, ref)
    return parity.INF if e.nonfinite else e


def nonfinite_note(x: np.ndarray, what: str) -> str:
    """A failure note if ``x`` holds NaN or infinities (argmax of NaN logits agrees with anything), else ''."""
    bad = ~np.isfinite(np.asarray(x))
    return f"{what} hold {int(bad.sum())} NaN/infinite value(s)" if bad.any() else ""


def said_errors(e: parity.Errors) -> str:
    return f"max abs {e.max_abs:.2e} (max rel {e.max_rel:.2e}), rel L2 {e.rel_l2:.2e}"


class Validator:
    """What every check group shares: the model and its float64 copy, the export's manifest and budgets, the
    rounding floors measured so far, the random ids, and the checks added."""

    def __init__(self, export_dir: Path, model, manifest: Manifest, budgets: dict, seed: int, say: Progress,
                 overrides: dict | None = None, scratch: Path | None = None) -> None:
        self.export_dir, self.model, self.manifest, self.budgets, self.seed, self.say = export_dir, model, manifest, budgets, seed, say
        self.overrides = overrides or {}
        self.checks: list[Check] = []
        self.rng = np.random.default_rng(seed)
        self.specs = manifest.states
        self._model64 = None
        # state key -> (layer, name), as the model built the keys (a skeleton model says so; keys are never split)
        self.named = {key: (layer, name) for layer, keys in enumerate(model.layer_keys()) for name, key in keys.items()} \
            if hasattr(model, "layer_keys") else {}
        self.chunk = int(manifest.extra.get("chunk_size", protocol.chunk_size(model)))
        # the model's own fp32 rounding (PyTorch fp32 vs float64), the worst the checks have measured so far, per
        # kind ("logits", "state"): a check that measures none on its own inputs is held to this (parity.floored)
        self.floor: dict[str, parity.Errors] = {"logits": parity.NONE, "state": parity.NONE}
        self.no_floor = ""  # why the floor could not be measured
        # fp16 of a transformers checkpoint: the framework's own fp16 error, as the export measured it (edgelin.upstream)
        self.peer = up.PrecisionFloor.from_record(manifest.extra.get("precision_floor")) if manifest.precision in up.PRECISION_DTYPES else None
        # int8 / int4: the model computing the export's quantisation (edgelin.quantref), the states' reference; None:
        # the states are held to ``model``'s
        self.quantised = quantref.quantised_model(model, manifest, scratch=scratch)
        self.moe = bool(moe_layers(model))  # a mixture-of-experts model: its checks set aside tokens whose experts differ

    # ---- helpers -------------------------------------------------------------------------------
    def model64(self):
        """The model in float64 (the rounding floor, the long-stream and KV references): ``self.model`` run with its
        weights converted to float64 one layer at a time (``edgelin.layerwise``), each conversion kept where the
        whole float64 model fits in half the memory available, made again at every call where it does not."""
        if self._model64 is None:
            self._model64 = layerwise.Converted(self.model, keep=layerwise.fits_converted(self.model))
        return self._model64

    def drop_model64(self) -> None:
        """Let the float64 conversions go once their checks are done (a kept float64 model is twice the fp32 weights:
        the upstream framework's own float64 model, in its subprocess, needs that memory)."""
        self._model64 = None
        gc.collect()

    def rounding(self, ids: np.ndarray, ref: torch.Tensor, ref_state: dict[str, torch.Tensor]) -> tuple[parity.Errors, parity.Errors]:
        """The rounding floor of a prefill from a fresh state: PyTorch fp32's logits and states (``ref``,
        ``ref_state``, already computed on ``ids``) against the float64 model's on the same ids, as (logits
        errors, worst state rel L2); the running worst (``self.floor``) takes them in."""
        try:
            with torch.no_grad():
                ref64, state64 = self.model64()(torch.from_numpy(ids), fresh_state(self.specs, len(ids), dtype=torch.float64))
        except (RuntimeError, TypeError, ValueError) as exc:  # a module that computes in float32 only: no floor
            self.no_floor = self.no_floor or f"the model does not run in float64 ({str(exc).splitlines()[0][:200]})"
            return parity.NONE, parity.NONE
        return self.floors(ref, ref64, ref_state, state64)

    def floors(self, ref, ref64, state, state64) -> tuple[parity.Errors, parity.Errors]:
        """(logits, states) floors of fp32 outputs against float64 ones (tensors); the running worst takes them in."""
        logits = errors_or_inf(ref.numpy(), ref64.numpy())
        rel = max((parity.errors(state[s.key].detach().numpy(), state64[s.key].detach().numpy()).rel_l2 for s in self.specs), default=0.0)
        states = parity.Errors(0.0, rel, 0, None)
        self.floor = {"logits": self.floor["logits"].worst(logits), "state": self.floor["state"].worst(states)}
        return logits, states

    def held(self, kind: str, floor: parity.Errors | None = None) -> dict[str, float]:
        """The ``kind`` budget raised to the rounding floor (``floor``, else the worst measured so far), bounds
        a user or the export set kept as given."""
        bounds = parity.floored(self.budgets[kind], self.floor["state" if kind == "state" else "logits"] if floor is None else floor,
                                keep=self.overrides.get(kind, {}))
        if self.peer is not None and kind in PRECISION_KINDS:
            bounds = parity.floored(bounds, self.peer.errors, keep=self.overrides.get(kind, {}), factor=up.PRECISION_FACTOR)
        return bounds

    def add(self, check: Check) -> Check:
        kind = KIND_OF.get(check.group)
        if kind is not None:  # was its budget raised to the rounding floor?
            table = BUDGETS["fp32"]["upstream"] if check.name.startswith("import vs") else self.budgets[kind]
            table = {**parity.with_overrides({kind: table}, {kind: self.overrides.get(kind, {})})[kind], "state_rel_l2": self.budgets["state"]["rel_l2"]}
            check.floored = any(check.budget.get(b, 0.0) > v for b, v in table.items())
        self.checks.append(check)  # said once, in the table: progress names only the phases
        return check

    def ids(self, batch: int, length: int) -> np.ndarray:
        return self.rng.integers(0, self.manifest.vocab_size, (batch, length), dtype=np.int64)

    def compare_states(self, got: dict[str, np.ndarray], ref: dict[str, torch.Tensor], budget: dict) -> tuple[float, str]:
        """Worst relative L2 over the states (paired by key), and the first (graph order) state out of budget."""
        worst, first_bad = 0.0, ""
        for spec in self.specs:
            rel = parity.errors(got[spec.input], ref[spec.key].detach().numpy()).rel_l2
            worst = max(worst, rel)
            if rel > budget["rel_l2"] and not first_bad:
                what = f"layer {self.named[spec.key][0]}, state {self.named[spec.key][1]}" if spec.key in self.named else f"state {spec.key}"
                first_bad = f"{what} ({spec.output}): rel L2 {rel:.2e}"
        return worst, first_bad
