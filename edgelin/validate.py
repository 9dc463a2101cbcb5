"""Parity: is an export the model it claims to be? PyTorch vs ONNX Runtime, prefill vs decode, across providers.

``validate(export_dir, checkpoint)`` runs every check, collects every failure (not just the first) and
returns a ``Report``: one ``Check`` per comparison with its numbers, the budget it was held to, a verdict,
and on failure where it diverged first (step, layer, state). ``edgelin validate`` prints it as a table.

Checks, in order:
 1. structure   manifest <-> graphs (names, dtypes, ranks, symbolic dims); metadata == sidecar; weights hash
 2. prefill     prefill graph vs PyTorch forward: logits and every final state, several T, batch > 1
 3. decode      decode graph vs PyTorch step, N steps, each side feeding back its own state
 4. graphs      prefill over T tokens == T decode steps; prefill continued from a state == one prefill
 5. golden      the export's golden outputs (golden.json, computed at export) on CPU, as `edgelin check` compares them
    providers   every requested provider vs CPU, prefill in pieces + multi-step decode (the runtime check's
                comparison, edgelin.runtime.golden, on this run's inputs); an inactive one is "n/a"
 6. long        N decode steps vs a float64 PyTorch run: drift curve, non-finite values
 7. behaviour   greedy continuation ORT vs PyTorch; top-1 agreement under teacher forcing
 8. upstream    for a foreign checkpoint, the framework it came from (transformers, fla) running its own model on
                the same ids (edgelin.upstream, in a subprocess): edgelin's import vs it and the graphs vs it --
                prefill logits, cached decode logits, greedy ids; a departing import names its first layer

An int8 or int4 export's states (checks 2, 3 and the KV-cache check) are held to PyTorch computing the export's own
quantisation (edgelin.quantref: the dequantised weights, the activations rounded as ONNX Runtime rounds them), its
logits to fp32 PyTorch: the first says the graphs compute that quantisation, the second how far it moves the model.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from edgelin import parity, protocol, quantref, upstream as up
from edgelin.checkpoint import load_checkpoint, model_sha256, open_checkpoint, weights_sha256
from edgelin.errors import EdgelinError, ManifestError, ProviderError
from edgelin.parity import BUDGETS
from edgelin.runtime import golden
from edgelin.runtime.check import check_graph
from edgelin.runtime.files import json_format, write_json
from edgelin.runtime.manifest import Manifest, join_problems
from edgelin.runtime.options import check_int
from edgelin.runtime.session import EXECUTION_PROVIDERS, Session, open_session
from edgelin.state import from_numpy, fresh_state
from edgelin.threads import torch_threads

PASS, FAIL, NA = "pass", "fail", "n/a"
KV_LENGTHS = (1024, 16384)  # a KV cache (and every other state) after prompts this long vs float64 (the "kv" group)
REPORT_FORMAT = "edgelin-validate/1"  # the report's own format key: how a later --json recognises a report edgelin wrote
REPORT_FILE = json_format("edgelin-validate/", "an edgelin validate report (JSON with format edgelin-validate/1)")
Progress = Callable[[str], None]
REF_LOGITS_BYTES = 256 << 20  # the float64 reference's logits held at once in the long-prompt (kv) checks


@dataclass
class Check:
    group: str  # structure | prefill | decode | graphs | golden | providers | long | behaviour
    name: str
    status: str  # pass | fail | n/a
    max_abs: float | None = None
    rel_l2: float | None = None
    budget: dict[str, float] = field(default_factory=dict)
    where: str = ""  # on failure: first diverging step / layer / state, or what is wrong
    max_rel: float | None = None  # max abs / max(1, max |reference|): the bound that scales with the logits
    floored: bool = False  # the budget was raised to the model's rounding floor (parity.floored)

    @classmethod
    def of(cls, group: str, name: str, ok: bool, errors: parity.Errors, budget: dict[str, float], where: str = "") -> "Check":
        """A numeric check from its (worst) errors."""
        return cls(group, name, PASS if ok else FAIL, errors.max_abs, errors.rel_l2, dict(budget), where, errors.max_rel)

    @property
    def failed(self) -> bool:
        return self.status == FAIL


@dataclass
class Report:
    export_dir: str
    checkpoint: str
    precision: str
    providers: dict[str, str]  # requested -> "active" | "not available: why"
    checks: list[Check] = field(default_factory=list)
    drift: list[dict[str, float]] = field(default_factory=list)  # long stream: step -> errors
    heldout: dict[str, float] = field(default_factory=dict)  # bits/byte of the export and fp32 PyTorch, delta, top-1
    seconds: float = 0.0
    strict_providers: bool = True  # an unavailable provider that was asked for by name fails the run
    budgets: dict[str, dict[str, float]] = field(default_factory=dict)  # the budgets held to (overrides included)
    overrides: dict[str, dict[str, float]] = field(default_factory=dict)  # bounds set by the export or --budget
    # the framework's own run (--upstream): framework, how it ran, its model class, seconds; {} where none ran
    upstream: dict[str, Any] = field(default_factory=dict)
    prepack: bool = True  # ONNX Runtime's CPU sessions packed their weights (the runtime's default) or read them in place
    # the model's own fp32 rounding, the worst the checks measured (PyTorch fp32 vs float64 on their inputs):
    # {"logits": {"max_rel", "rel_l2"}, "state": {"rel_l2"}, "factor"}; budgets below factor x it were raised to it
    rounding_floor: dict[str, Any] = field(default_factory=dict)
    # fp16 exports of a transformers checkpoint: its framework's own error at fp16 (measured at export, from the
    # manifest's "precision_floor"); logits and upstream budgets below PRECISION_FACTOR x it were raised to it
    precision_floor: dict[str, Any] = field(default_factory=dict)
    # int8 / int4: what the PyTorch model the states were held to computes (edgelin.quantref.arithmetic); "" where
    # the states were held to fp32 PyTorch
    state_reference: str = ""

    @property
    def passed(self) -> bool:
        if any(c.failed for c in self.checks):
            return False
        if self.strict_providers and any(v != "active" for v in self.providers.values()):
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        d = {"format": REPORT_FORMAT, **asdict(self)}
        d["passed"] = self.passed
        d["budgets"] = self.budgets or BUDGETS[self.precision]
        return d

    def table(self) -> str:
        rows = [("group", "check", "max abs", "max rel", "rel L2", "budget", "result")]
        for c in self.checks:
            budget = " ".join(f"{k[4:]}>={v:g}" if k.startswith("min_") else f"{k}<={v:g}" for k, v in c.budget.items())
            rows.append((c.group, c.name, _num(c.max_abs), _num(c.max_rel), _num(c.rel_l2), budget, c.status.upper() if c.failed else c.status))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for c in self.checks:
            if c.where and c.status != PASS:
                lines.append(f"  {c.group}/{c.name}: {c.where}")
        if self.drift:
            last = self.drift[-1]
            lines.append(
                f"long stream: {int(last['step'])} steps, max abs logits error {last['max_abs']:.2e}, "
                f"rel L2 {last['rel_l2']:.2e} at the end (drift curve in --json)"
            )
        if self.upstream.get("framework"):
            u = self.upstream
            lines.append(f"upstream: {u['model_class']} run by {u['how']}, {u['seconds']['total']:.1f} s")
        raised = [c for c in self.checks if c.floored]
        if self.rounding_floor.get("not_measured"):
            lines.append(f"rounding floor: not measured everywhere: {self.rounding_floor['not_measured']}; edgelin's budgets apply as they are there")
        if self.precision_floor:
            p = self.precision_floor
            lines.append(f"precision floor: {up.possessive(p['framework'])} own model in {p['dtype']} is {p['max_rel']:.1e} (max rel) / "
                         f"{p['rel_l2']:.1e} (rel L2) from its float64 run (measured at export); logits budgets below {p['factor']:g}x it "
                         "were raised to it")
            raised = [c for c in raised if c.group not in _PRECISION_FLOORED]
        if raised:
            f = self.rounding_floor
            lines.append(f"rounding floor: PyTorch fp32 itself is up to max rel {f['logits']['max_rel']:.1e}, rel L2 {f['logits']['rel_l2']:.1e} "
                         f"(states {f['state']['rel_l2']:.1e}) from float64 on these inputs; {len(raised)} check(s) held to "
                         f"{f['factor']:g}x it where edgelin's budget is lower")
        if self.state_reference:
            lines.append(f"states held to PyTorch computing the export's {self.precision} arithmetic ({self.state_reference}); the logits to fp32 PyTorch")
        if not self.prepack:
            lines.append("ONNX Runtime's CPU session read the weights in place (--no-prepack): the same kernels on unpacked weights")
        if self.overrides:
            lines.append("budgets set for this export or by --budget: "
                         + ", ".join(f"{k}.{b}={v:g}" for k, bounds in self.overrides.items() for b, v in bounds.items()))
        counts = {s: sum(c.status == s for c in self.checks) for s in (PASS, FAIL, NA)}
        verdict = "PASS" if self.passed else "FAIL"
        tail = ""
        if self.strict_providers and any(v != "active" for v in self.providers.values()):
            tail = " -- a provider named in --providers is not available"
        lines.append(f"{verdict}: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[NA]} not available ({self.seconds:.1f} s){tail}")
        return "\n".join(lines)

    def write_json(self, path: str | Path, *, overwrite: bool = False) -> None:
        """Write the report atomically. An existing file is replaced only if it is an earlier report (its
        ``format`` is ``edgelin-validate/...``) and not part of an export, or with ``overwrite=True``."""
        # non-finite errors (a failed check) become null: valid JSON
        write_json(path, self.to_dict(), overwrite=overwrite, ours=REPORT_FILE, what="report file")


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"


def _errors(got: np.ndarray, ref: np.ndarray) -> parity.Errors:
    e = parity.errors(got, ref)
    return parity.INF if e.nonfinite else e


def _nonfinite(x: np.ndarray, what: str) -> str:
    """A failure note if ``x`` holds NaN or infinities (argmax of NaN logits agrees with anything), else ''."""
    bad = ~np.isfinite(np.asarray(x))
    return f"{what} hold {int(bad.sum())} NaN/infinite value(s)" if bad.any() else ""


def _said(e: parity.Errors) -> str:
    return f"max abs {e.max_abs:.2e} (max rel {e.max_rel:.2e}), rel L2 {e.rel_l2:.2e}"


# check group -> the budget kind it is held to (before the rounding floor)
_KIND_OF = {"prefill": "logits", "decode": "logits", "graphs": "logits", "golden": "logits", "providers": "provider", "long": "long",
            "kv": "long", "upstream": "upstream"}
_PRECISION_KINDS = ("logits", "upstream")  # the kinds the fp16 precision floor raises (edgelin.upstream.precision_floor)
_PRECISION_FLOORED = tuple(group for group, kind in _KIND_OF.items() if kind in _PRECISION_KINDS)


class _Validator:
    def __init__(self, export_dir: Path, model, manifest: Manifest, budgets: dict, seed: int, say: Progress,
                 overrides: dict | None = None) -> None:
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
        self.quantised = quantref.quantised_model(model, manifest)

    # ---- helpers -------------------------------------------------------------------------------
    def model64(self):
        """The model in float64 (the long-stream and KV references), copied once per validation."""
        if self._model64 is None:
            self._model64 = copy.deepcopy(self.model).double().eval()
        return self._model64

    def drop_model64(self) -> None:
        """Let the float64 copy go once its checks are done (twice the fp32 weights: at real size the upstream
        framework's own float64 model, in its subprocess, needs that memory)."""
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
        logits = _errors(ref.numpy(), ref64.numpy())
        rel = max((parity.errors(state[s.key].detach().numpy(), state64[s.key].detach().numpy()).rel_l2 for s in self.specs), default=0.0)
        states = parity.Errors(0.0, rel, 0, None)
        self.floor = {"logits": self.floor["logits"].worst(logits), "state": self.floor["state"].worst(states)}
        return logits, states

    def held(self, kind: str, floor: parity.Errors | None = None) -> dict[str, float]:
        """The ``kind`` budget raised to the rounding floor (``floor``, else the worst measured so far), bounds
        a user or the export set kept as given."""
        bounds = parity.floored(self.budgets[kind], self.floor["state" if kind == "state" else "logits"] if floor is None else floor,
                                keep=self.overrides.get(kind, {}))
        if self.peer is not None and kind in _PRECISION_KINDS:
            bounds = parity.floored(bounds, self.peer.errors, keep=self.overrides.get(kind, {}), factor=up.PRECISION_FACTOR)
        return bounds

    def add(self, check: Check) -> Check:
        kind = _KIND_OF.get(check.group)
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

    # ---- 2. prefill vs PyTorch -----------------------------------------------------------------
    def prefill_vs_torch(self, session: Session) -> None:
        C = self.chunk
        for batch, T in ((1, 1), (3, max(C - 1, 1)), (2, C + 1), (3, 3 * C + 5)):
            ids = self.ids(batch, T)
            state = session.new_state(batch)
            logits = session.prefill(ids, state)
            with torch.no_grad():
                ref, ref_state = self.model(torch.from_numpy(ids))
                held_state = ref_state if self.quantised is None else self.quantised(torch.from_numpy(ids))[1]
            floor, state_floor = self.rounding(ids, ref, ref_state)
            lb, sb = self.held("logits", floor), self.held("state", state_floor)
            e = _errors(logits, ref.numpy())
            state_rel, bad_state = self.compare_states(state.numpy(), held_state, sb)
            ok = parity.within(e, lb) and not bad_state
            where = ""
            if not ok:
                where = _nonfinite(logits, "ORT logits") or bad_state or f"logits out of budget: {_said(e)}"
                if bad_state and parity.within(e, lb):
                    where += " (logits within budget)"
            self.add(Check.of("prefill", f"T={T} batch={batch}", ok, e, {**lb, "state_rel_l2": sb["rel_l2"]}, where))

    # ---- 3. decode vs PyTorch, state fed back --------------------------------------------------
    def decode_vs_torch(self, session: Session, steps: int) -> None:
        batch = 2
        ids = self.ids(batch, steps)
        state = session.new_state(batch)
        ref_state = fresh_state(self.specs, batch)
        held_state = None if self.quantised is None else fresh_state(self.specs, batch)  # the quantised model's chain
        state64 = fresh_state(self.specs, batch, dtype=torch.float64)
        worst, where = parity.NONE, ""
        floor, state_floor = parity.NONE, parity.NONE  # the worst over the steps so far: rounding accumulates in the state
        for t in range(steps):
            logits = session.decode(ids[:, t : t + 1], state)
            with torch.no_grad():
                x = torch.from_numpy(ids[:, t : t + 1])
                ref, ref_state = self.model.step(x, ref_state)
                if held_state is not None:
                    held_state = self.quantised.step(x, held_state)[1]
                if not self.no_floor:
                    try:
                        ref64, state64 = self.model64().step(x, state64)
                    except (RuntimeError, TypeError, ValueError) as exc:
                        self.no_floor = f"the model does not run in float64 ({str(exc).splitlines()[0][:200]})"
            if not self.no_floor:
                f, fs = self.floors(ref, ref64, ref_state, state64)
                floor, state_floor = floor.worst(f), state_floor.worst(fs)
            lb, sb = self.held("logits", floor), self.held("state", state_floor)
            e = _errors(logits, ref.numpy())
            worst = worst.worst(e)
            if not where:
                _, bad_state = self.compare_states(state.numpy(), ref_state if held_state is None else held_state, sb)
                if bad_state or not parity.within(e, lb):
                    where = f"first diverging step {t}: " + (bad_state or f"logits {_said(e)}")
        self.add(Check.of("decode", f"{steps} steps, state fed back", not where, worst, lb, where))

    # ---- 4. the two graphs agree ---------------------------------------------------------------
    def graphs_agree(self, session: Session) -> None:
        C = self.chunk
        T = 2 * C + 3
        ids = self.ids(2, T)
        with torch.no_grad():  # two fp32 programs of different orders: the floor of a prefill over these ids
            self.rounding(ids, *self.model(torch.from_numpy(ids)))
        lb, sb = self.held("logits"), self.held("state")
        p_state = session.new_state(2)
        p_logits = session.prefill(ids, p_state)
        d_state = session.new_state(2)
        worst, where = parity.NONE, ""
        for t in range(T):
            d_logits = session.decode(ids[:, t : t + 1], d_state)
            e = _errors(d_logits[:, 0], p_logits[:, t])
            worst = worst.worst(e)
            if not where and not parity.within(e, lb):
                where = f"first diverging position {t}: logits {_said(e)}"
        state_rel, bad = self.compare_states(d_state.numpy(), from_numpy(self.specs, p_state.numpy()), sb)
        where = where or bad
        self.add(Check.of("graphs", f"prefill({T}) == {T} decode steps", not where, worst, lb, where))

        whole_state = session.new_state(2)
        whole = session.prefill(ids, whole_state)
        split_state = session.new_state(2)
        a = session.prefill(ids[:, : C + 2], split_state)
        b = session.prefill(ids[:, C + 2 :], split_state)
        e = _errors(np.concatenate([a, b], axis=1), whole)
        _, bad = self.compare_states(split_state.numpy(), from_numpy(self.specs, whole_state.numpy()), sb)
        ok = parity.within(e, lb) and not bad
        self.add(Check.of("graphs", "prefill(a); prefill(b, state) == prefill(a+b)", ok, e, lb,
                          "" if ok else (bad or f"logits out of budget: {_said(e)}")))

    def ragged_agrees(self, session: Session) -> None:
        """A ragged export (the manifest's ``lengths``): prompts of 1, C - 1, C + 1 and 3 C + 5 tokens prefilled
        together == each prompt prefilled alone (last logits, every state row), run two ways: in one call, and
        as a batched Generator runs them (grouped by length at <= 1.25x padding), here in pieces of C + 1
        tokens so that rows end in different pieces."""
        lb, sb = self.held("logits"), self.held("state")
        C = self.chunk
        prompts = [self.ids(1, T)[0] for T in (1, max(C - 1, 1), C + 1, 3 * C + 5)]
        alone = []  # (last logits [1, V], state) of each prompt prefilled alone
        for ids in prompts:
            state = session.new_state(1)
            alone.append((session.prefill(ids[None], state, last_only=True), from_numpy(self.specs, state.numpy())))
        worst, where = parity.NONE, ""
        for how, options in (("one call", {}), (f"grouped, in pieces of {C + 1}", {"chunk": C + 1, "max_padding": 1.25})):
            last, state = session.prefill_batch(prompts, **options)
            batched = state.numpy()
            for b, ids in enumerate(prompts):
                e = _errors(last[b : b + 1], alone[b][0])
                worst = worst.worst(e)
                _, bad = self.compare_states({name: a[b : b + 1] for name, a in batched.items()}, alone[b][1], sb)
                if not where and (bad or not parity.within(e, lb)):
                    where = f"{how}, prompt {b} ({len(ids)} tokens): " + (bad or f"last logits {_said(e)}")
        self.add(Check.of("graphs", "ragged prefill == each prompt alone (one call; grouped in pieces)", not where, worst, lb, where))

    # ---- 5. providers --------------------------------------------------------------------------
    def provider_vs_cpu(self, cpu_rows: np.ndarray, other: Session, name: str, plan: golden.Plan) -> None:
        """The runtime check's comparison across providers (``edgelin.runtime.golden``) on this run's inputs."""
        for r in golden.against_provider(golden.run_plan(other, plan), cpu_rows, plan, self.held("provider"), "cpu"):
            self.add(Check.of("providers", f"{name}: {r.name}", r.passed, r.errors, r.budget, r.where))

    def golden_outputs(self, session: Session, gold: golden.Golden) -> None:
        """The export's golden outputs (computed at export) as the runtime check compares them, held to this run's
        logits budget (the export's own bounds and --budget included)."""
        for r in golden.against_golden(golden.run_plan(session, gold.plan), gold, self.held("logits", (gold.floor or parity.NONE).worst(self.floor["logits"]))):
            self.add(Check.of("golden", r.name, r.passed, r.errors, r.budget, r.where))

    # ---- 6. long stream vs float64 -------------------------------------------------------------
    def long_stream(self, session: Session, steps: int) -> list[dict[str, float]]:
        lb = self.held("long")
        model64 = self.model64()
        ids = self.ids(1, steps)
        state = session.new_state(1)
        ref_state = fresh_state(self.specs, 1, dtype=torch.float64)
        marks = sorted({min(steps, int(round(x))) for x in np.geomspace(1, steps, 25)} | {steps})
        curve, worst, nonfinite, where = [], parity.NONE, "", ""
        t0 = time.perf_counter()
        for t in range(steps):
            logits = session.decode(ids[:, t : t + 1], state)
            with torch.no_grad():
                ref, ref_state = model64.step(torch.from_numpy(ids[:, t : t + 1]), ref_state)
            if not nonfinite and not np.isfinite(logits).all():
                nonfinite = f"non-finite logits at step {t}"
            e = _errors(logits, ref.numpy())
            worst = worst.worst(e)
            if not where and not parity.within(e, lb):
                where = f"first step out of budget: {t} ({_said(e)})"
            if t + 1 in marks:
                finite_states = all(np.isfinite(v).all() for v in state.numpy().values())
                if not finite_states and not nonfinite:
                    nonfinite = f"non-finite state by step {t}"
                curve.append({"step": t + 1, "max_abs": worst.max_abs, "max_rel": worst.max_rel, "rel_l2": worst.rel_l2, "step_max_abs": e.max_abs})
            if (t + 1) % 2000 == 0:
                self.say(f"  long stream: {t + 1}/{steps} steps ({time.perf_counter() - t0:.0f} s), max abs so far {worst.max_abs:.2e}")
        where = nonfinite or where
        self.add(Check.of("long", f"{steps} steps vs float64", not where, worst, lb, where))
        return curve

    # ---- 6b. a growing state (KV cache) after long prompts vs float64 ------------------------------
    def kv_cache(self, session: Session, lengths: Sequence[int]) -> None:
        """A model with a KV cache: a prompt of each length prefilled through the graphs in the runtime's pieces; every
        state (the caches: keys after RoPE, values; and the linear layers' states) against the float64 PyTorch model
        run over the same ids in pieces (its attention is SDPA in float64), and the last position's logits (the
        long-stream budget). Lengths past the model's declared context are not run (n/a, saying why)."""
        sb, lb = self.held("state"), self.held("long")
        model64 = self.model64()
        # the float64 model's pieces: its logits of a piece are piece x V float64 values (2 GB at 1,024 x 248k, where a
        # Qwen3.5-0.8B's validate was killed for memory); at most REF_LOGITS_BYTES of them
        piece = max(1, min(self.manifest.prefill_piece, REF_LOGITS_BYTES // (8 * self.manifest.vocab_size)))
        for L in lengths:
            name = f"{L:,} tokens prefilled vs float64"
            limit = self.manifest.max_positions
            if limit is not None and L > limit:
                self.add(Check("kv", name, NA, where=f"past the model's context of {limit:,} positions (max_positions)"))
                continue
            ids = self.ids(1, L)
            state = session.new_state(1)
            last = session.prefill(ids, state, last_only=True)  # the runtime's default: pieces of prefill_piece
            ref_state = fresh_state(self.specs, 1, dtype=torch.float64)
            held_state = None if self.quantised is None else fresh_state(self.specs, 1)
            with torch.no_grad():
                for a in range(0, L, piece):
                    ref, ref_state = model64(torch.from_numpy(ids[:, a : a + piece]), ref_state)
                # the export's arithmetic in fp32, in the runtime's pieces (int8 per channel rounds a call's activations
                # with one scale: the pieces are part of what it computes)
                for a, b in session._pieces(L, None) if held_state is not None else ():
                    held_state = self.quantised(torch.from_numpy(ids[:, a:b]), held_state)[1]
            e = _errors(last, ref[:, -1].numpy())
            state_rel, bad_state = self.compare_states(state.numpy(), ref_state if held_state is None else held_state, sb)
            ok = parity.within(e, lb) and not bad_state
            where = "" if ok else (_nonfinite(last, "ORT logits") or bad_state or f"last logits out of budget: {_said(e)}")
            self.add(Check.of("kv", name, ok, e, {**lb, "state_rel_l2": sb["rel_l2"]}, where))

    # ---- 7. behaviour --------------------------------------------------------------------------
    def behaviour(self, session: Session, k: int) -> None:
        if self.budgets["greedy"]["min_agreement"] >= 1.0:  # exact greedy equality (fp32); else see greedy_agreement
            self._greedy_exact(session, k)
        self._top1(session)

    def _greedy_exact(self, session: Session, k: int) -> None:
        prompt = self.ids(1, 24)
        state = session.new_state(1)
        logits = session.prefill(prompt, state)[:, -1]  # [1, V]
        ort_tokens, nonfinite = [], _nonfinite(logits, "ORT logits after the prompt")
        for i in range(k):
            nonfinite = nonfinite or _nonfinite(logits, f"ORT logits at greedy step {i}")
            tok = int(logits[0].argmax())
            ort_tokens.append(tok)
            logits = session.decode(np.array([[tok]]), state)[:, -1]
        with torch.no_grad():
            ref, ref_state = self.model(torch.from_numpy(prompt))
            ref = ref[:, -1]
            torch_tokens = []
            for _ in range(k):
                tok = int(ref[0].argmax())
                torch_tokens.append(tok)
                ref, ref_state = self.model.step(torch.tensor([[tok]]), ref_state)
                ref = ref[:, -1]
        first = next((i for i, (a, b) in enumerate(zip(ort_tokens, torch_tokens)) if a != b), None)
        where = nonfinite or ("" if first is None else f"first different token at {first}: ORT {ort_tokens[first]} vs PyTorch {torch_tokens[first]}")
        self.add(Check("behaviour", f"greedy {k} tokens ORT == PyTorch", FAIL if where else PASS, where=where))

    def _top1(self, session: Session) -> None:
        # teacher-forced top-1 agreement over a sequence (informational: near-ties may flip)
        ids = self.ids(2, 200)
        got = session.prefill(ids, session.new_state(2))
        with torch.no_grad():
            want = self.model(torch.from_numpy(ids))[0].numpy()
        agree = parity.agreement(got, want)
        need = self.budgets["top1"]["min_agreement"]
        where = _nonfinite(got, "ORT logits") or _nonfinite(want, "PyTorch logits") or ("" if agree >= need else f"agreement {agree:.4f} < {need}")
        self.add(Check("behaviour", f"top-1 agreement {agree * 100:.2f}% (400 positions)", FAIL if where else PASS,
                       budget={"min_agreement": need}, where=where))

    # ---- 8. precision: greedy agreement and held-out text (every precision, against fp32 PyTorch) ----
    def greedy_agreement(self, session: Session, text: bytes | None, k: int = 64, prompts: int = 8) -> None:
        """Greedy continuations of ``prompts`` prompts (L tokens of the held-out text, spread over it; random ids
        for a model that reads no text), ORT vs fp32 PyTorch: the mean fraction of the k tokens generated before the
        first difference (a flipped near-tie ends a prompt's run)."""
        need = self.budgets["greedy"]["min_agreement"]
        L = 32
        ids = None if text is None else text_tokens(session, text)[0]
        if ids is not None and len(ids) >= prompts * L:
            step = len(ids) // prompts
            starts = np.stack([ids[i * step : i * step + L] for i in range(prompts)])  # [P, L]
        else:
            starts = self.ids(prompts, L)
        state = session.new_state(prompts)
        logits = session.prefill(starts, state, last_only=True)  # [P, V]
        ort_tokens = np.zeros((prompts, k), dtype=np.int64)
        for t in range(k):
            ort_tokens[:, t] = logits.argmax(-1)
            logits = session.decode(ort_tokens[:, t : t + 1], state)[:, -1]
        torch_tokens = np.zeros((prompts, k), dtype=np.int64)
        with torch.no_grad():
            ref, ref_state = self.model(torch.from_numpy(starts))
            ref = ref[:, -1]
            for t in range(k):
                torch_tokens[:, t] = ref.argmax(-1).numpy()
                ref, ref_state = self.model.step(torch.from_numpy(torch_tokens[:, t : t + 1]), ref_state)
                ref = ref[:, -1]
        same = np.cumprod(ort_tokens == torch_tokens, axis=1).sum(1)  # [P] tokens before the first difference
        agree = float(same.mean() / k)
        ok = agree >= need
        self.add(Check("precision", f"greedy {k} tokens x {prompts} prompts: {agree * 100:.1f}% before the first difference",
                       PASS if ok else FAIL, budget={"min_agreement": need},
                       where="" if ok else f"identical run lengths per prompt {same.tolist()} of {k}"))

    def heldout(self, session: Session, text: bytes | None, max_bytes: int, seq_len: int = 256) -> dict[str, float]:
        """Bits per byte of the export and of fp32 PyTorch on the first ``max_bytes`` of ``text`` as the export's
        tokenizer reads it (windows of seq_len tokens, each from a fresh state, every token after a window's first
        predicted once; the bytes are those the predicted tokens cover) and top-1 agreement over the same positions.
        A byte model reads one token per byte; a Hugging Face tokenizer's tokens cover several."""
        b = self.budgets["heldout"]
        if text is None:
            self.add(Check("precision", "held-out text: bits/byte delta", NA, where="needs a model that reads text (a byte or Hugging Face tokenizer)"))
            return {}
        data, ends = text_tokens(session, text[:max_bytes])
        n = (len(data) - 1) // seq_len
        if n < 1:
            self.add(Check("precision", "held-out text: bits/byte delta", NA, where=f"{len(data)} tokens: fewer than one window of {seq_len + 1}"))
            return {}
        windows = np.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])  # [n, seq_len + 1]
        count = int(sum(ends[i * seq_len + seq_len] - ends[i * seq_len] for i in range(n)))  # bytes of the predicted tokens
        nats_ort = nats_ref = 0.0
        agree = 0
        for start in range(0, n, 8):
            w = windows[start : start + 8]
            got = session.prefill(w[:, :-1], session.new_state(len(w))).astype(np.float64)  # [b, seq_len, V]
            with torch.no_grad():
                ref = self.model(torch.from_numpy(w[:, :-1]))[0].double().numpy()
            nats_ort += _nll(got, w[:, 1:])
            nats_ref += _nll(ref, w[:, 1:])
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        tokens = n * seq_len
        bpb_ort, bpb_ref = nats_ort / count / math.log(2), nats_ref / count / math.log(2)
        delta, top1 = bpb_ort - bpb_ref, agree / tokens
        ok = abs(delta) <= b["max_bpb_delta"] and top1 >= b["min_agreement"]
        what = f"{count} bytes" + ("" if tokens == count else f" ({tokens} tokens)")
        self.add(Check("precision", f"held-out {what}: {bpb_ort:.4f} bits/byte vs {bpb_ref:.4f} (delta {delta:+.4f}), top-1 {top1 * 100:.2f}%",
                       PASS if ok else FAIL, budget=dict(b),
                       where="" if ok else f"bits/byte delta {delta:+.4f}, top-1 agreement {top1:.4f}"))
        return {"bytes": count, "tokens": tokens, "bpb": bpb_ort, "bpb_fp32_torch": bpb_ref, "bpb_delta": delta, "top1": top1}

    # ---- 8. the framework the checkpoint came from -------------------------------------------------
    def upstream(self, session: Session, checkpoint: Path, framework: str, steps: int, threads: int, required: bool) -> dict[str, Any]:
        """edgelin's import and the graphs against ``framework``'s own model on the same ids: a prompt of C + 5
        tokens (batch 2: across a chunk boundary), ``steps`` tokens through its cache, GREEDY greedy tokens. The import
        is held to the fp32 upstream budget (both are fp32 PyTorch), the graphs to the export precision's."""

        C = self.chunk
        prompt, ids = self.ids(2, C + 5), self.ids(2, steps)
        slow = " (its kernels in Triton's interpreter: minutes; --steps bounds it)" if framework == "fla" else ""
        self.say(f"upstream: running {up.possessive(framework)} own model on the checkpoint, {steps} decode steps, in a subprocess{slow} ...")
        try:
            ref = up.run(checkpoint, framework, prompt, ids, threads=threads)
        except up.UpstreamError as exc:
            self.add(Check("upstream", f"import vs {framework}", FAIL if required else NA, where=str(exc)))
            return {}
        fp32 = parity.with_overrides(BUDGETS["fp32"], {k: v for k, v in self.overrides.items() if k == "upstream"})["upstream"]
        fp32 = parity.floored(fp32, self.floor["logits"], keep=self.overrides.get("upstream", {}))
        graph_budget = self.held("upstream")
        k = ref.greedy.shape[1]
        mine_prefill, mine_decode, mine_greedy, mine_hidden = up.import_outputs(self.model, prompt, ids, k)
        departs = ""

        def departure() -> str:
            nonlocal departs
            departs = departs or up.first_departure(self.model, mine_hidden, ref.hidden, fp32["rel_l2"])
            return departs

        T, B = prompt.shape[1], prompt.shape[0]
        need = self.budgets["greedy"]["min_agreement"]
        # the import vs the framework
        e = _errors(mine_prefill, ref.prefill)
        ok = import_ok = parity.within(e, fp32)
        self.add(Check.of("upstream", f"import vs {framework}: prefill T={T} batch={B}", ok, e, fp32, "" if ok else departure()))
        e, where = self._steps(mine_decode, ref.decode, fp32)
        if where and not import_ok:
            where += f"; over the prompt it {departure()}"
        self.add(Check.of("upstream", f"import vs {framework}: {steps} cached decode steps", not where, e, fp32, where))
        # the graphs vs the framework
        state = session.new_state(B)
        got_prefill = session.prefill(prompt, state)
        got_decode = np.stack([session.decode(ids[:, t : t + 1], state)[:, -1] for t in range(steps)])
        e = _errors(got_prefill, ref.prefill)
        ok = parity.within(e, graph_budget)
        note = "" if ok else (f"logits {_said(e)}" + ("" if import_ok else f"; the import {departure()}"))
        self.add(Check.of("upstream", f"graphs vs {framework}: prefill T={T} batch={B}", ok, e, graph_budget, note))
        e, where = self._steps(got_decode, ref.decode, graph_budget)
        self.add(Check.of("upstream", f"graphs vs {framework}: {steps} decode steps, state fed back", not where, e, graph_budget, where))
        # greedy ids after the prompt and the steps, each side through its own state
        got = up.greedy_ids(got_decode[-1], lambda tok: session.decode(tok, state)[:, -1], k)
        for who, ids_k in (("import", mine_greedy), ("graphs", got)):
            agree, where = up.greedy_agreement(ids_k, ref.greedy)
            bound = need if who == "graphs" else 1.0  # the import is fp32 PyTorch: token for token
            ok = agree >= bound
            self.add(Check("upstream", f"{who} vs {framework}: greedy {k} tokens x {B} rows, {agree * 100:.0f}% before the first difference",
                           PASS if ok else FAIL, budget={"min_agreement": bound}, where="" if ok else where))
        return {"framework": framework, "how": ref.how, "model_class": ref.model_class, "seconds": ref.seconds,
                "prompt_tokens": T, "batch": B, "decode_steps": steps, "greedy_tokens": k}

    def _steps(self, got: np.ndarray, ref: np.ndarray, budget: dict) -> tuple[parity.Errors, str]:
        """Worst errors over decode steps [N, B, V], and the first step out of budget."""
        worst, where = parity.NONE, ""
        for t in range(ref.shape[0]):
            e = _errors(got[t], ref[t])
            worst = worst.worst(e)
            if not where and not parity.within(e, budget):
                where = f"first diverging step {t}: logits {_said(e)}"
        return worst, where


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed -log p(target) in nats; logits [b, T, V] float64, targets [b, T]."""
    top = logits.max(-1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]  # [b, T]
    return float((logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]).sum())


def heldout_text(manifest: Manifest) -> bytes | None:
    """The held-out text of the bundled model's corpus (standard-library modules it never saw in training,
    ``edgelin.models.corpus``), for an export that reads text: a byte tokenizer (256 ids or more) or a Hugging Face
    tokenizer; None where the model reads other tokens."""
    kind = manifest.tokenizer.get("kind")
    if not (kind == "bytes" and manifest.vocab_size >= 256) and kind != "huggingface":
        return None
    from edgelin.models import corpus

    return corpus.heldout_text("code") or None


def text_tokens(session: Session, text: bytes) -> tuple[np.ndarray, np.ndarray]:
    """``text`` as the export's tokenizer reads it, without special tokens: (ids int64 [N], for each token the byte
    offset in ``text`` where it ends [N]). A byte tokenizer: one token per byte (ends 1, 2, ...); a Hugging Face one:
    its ids for the text decoded as UTF-8 (an incomplete character at the end dropped)."""
    spec = session.manifest.tokenizer
    if spec.get("kind") == "bytes":
        ids = np.frombuffer(text, np.uint8).astype(np.int64) + int(spec.get("offset") or 0)
        return ids, np.arange(1, len(ids) + 1, dtype=np.int64)
    string = text.decode("utf-8", errors="ignore")
    encoding = session.tokenizer.tokenizer.encode(string, add_special_tokens=False)
    byte_at = np.concatenate([[0], np.cumsum([len(c.encode("utf-8")) for c in string])])  # character -> byte offset
    return np.asarray(encoding.ids, np.int64), byte_at[[end for _, end in encoding.offsets]].astype(np.int64)


# ---- 1. structure ------------------------------------------------------------------------------
def check_structure(export_dir: Path, manifest: Manifest, checkpoint: Path | None, model) -> list[Check]:
    """Manifest <-> graphs (the runtime's check_graph, with the embedded manifest compared by content),
    source hash <-> checkpoint, config <-> manifest, graph files <-> the manifest's sha256. Every problem is listed."""
    checks = []
    if manifest.sha256 is None:
        checks.append(Check("structure", "graph files <-> edgelin.json sha256", NA, where="an edgelin/1 manifest has no graph hashes"))
    else:
        problems = manifest.file_problems(export_dir)
        checks.append(Check("structure", "graph files <-> edgelin.json sha256", FAIL if problems else PASS, where=join_problems(problems)))
    for graph, fname in manifest.graphs.items():
        try:
            sess = open_session(export_dir / fname, "cpu", optimization="disable")
        except ManifestError as exc:
            checks.append(Check("structure", f"{graph} graph", FAIL, where=str(exc)))
            continue
        problems = check_graph(graph, fname, sess, manifest, metadata="content")
        checks.append(Check("structure", f"{graph} graph <-> manifest", FAIL if problems else PASS, where="; ".join(problems)))

    if checkpoint is not None and model is not None:
        problems = []
        digest = weights_sha256(checkpoint)
        if digest != manifest.source:
            problems.append(f"weights sha256 {digest[:12]}... != manifest source {manifest.source[:12]}...")
        cfg = model.model_config()
        diff = sorted(k for k in set(cfg) | set(manifest.model) if k != "chunk_size" and manifest.model.get(k) != cfg.get(k))
        if diff:
            problems.append(f"config differs in {', '.join(diff)}")
        checks.append(Check("structure", "source weights + config", FAIL if problems else PASS, where="; ".join(problems)))
    return checks


def _contract_mismatch(model, manifest: Manifest) -> str:
    """What makes ``model`` another model than the export's, so that no output can be compared: its vocabulary
    or its state contract (names and shapes; not dtypes, which an export may store in float16); "" when they agree."""
    if model.vocab_size != manifest.vocab_size:
        return f"the checkpoint's model has a vocabulary of {model.vocab_size:,}, the export {manifest.vocab_size:,}"
    theirs = {s.input: (s.output, tuple(s.shape)) for s in model.state_specs()}
    ours = {s.input: (s.output, tuple(s.shape)) for s in manifest.states}
    if theirs != ours:
        name = (sorted(set(theirs) ^ set(ours)) or sorted(k for k in ours if theirs[k] != ours[k]))[0]

        def said(states):
            return str(list(states[name][1])) if name in states else "none"

        return f"the checkpoint's model and the export differ in their state {name} (checkpoint: {said(theirs)}; export: {said(ours)})"
    return ""


def _resolve_checkpoint(manifest: Manifest, checkpoint: str | Path | None) -> Path:
    if checkpoint is not None:
        return Path(checkpoint)
    from edgelin.models import bundled_checkpoint

    bundled = bundled_checkpoint()
    if bundled is not None and weights_sha256(bundled) == manifest.source:
        return bundled
    raise EdgelinError("this export is not of the bundled model: pass --checkpoint with the checkpoint it was exported from")


def validate(
    export_dir: str | Path,
    checkpoint=None,
    *,
    providers: str | list[str] = "cpu",
    steps: int = 64,
    long: int = 0,
    seed: int = 0,
    threads: int = 1,
    progress: Progress | None = None,
    heldout_bytes: int = 8192,
    budget=None,
    upstream: str = "auto",
    kv: Sequence[int] = KV_LENGTHS,
    prepack: bool = True,
) -> Report:
    """Run every check on ``export_dir`` against ``checkpoint`` (a folder, a model that follows
    edgelin.protocol, or None = the bundled model).

    The comparisons run token by token on small tensors, where one thread is fastest (and extra threads
    only contend): torch and the ONNX Runtime sessions use ``threads`` (default 1) while this runs.

    ``budget``: bounds to hold the export to instead of edgelin's for its precision, as {kind: {bound:
    value}} or ``KIND.BOUND=VALUE`` strings (``edgelin.parity.parse_override``); they apply over those the
    export was made with (``edgelin export --budget``, the manifest's ``parity_budgets``). The report
    records every bound it held and which were set.

    ``upstream``: for a foreign checkpoint folder (transformers', fla's), also run the framework it came from on the
    same ids and compare it with the import and with the graphs (the "upstream" group; edgelin.upstream). "auto": where
    the framework is installed (otherwise the group says what it could not compare and how to enable it); "required":
    an EdgelinError before anything runs where it cannot be made; "off": not at all.

    ``kv``: for a model with a KV cache (a hybrid), prompt lengths whose cache (and every other state) after the
    prompt is compared with the float64 model's (the "kv" group; default 1k and 16k, each within the model's declared
    context; () for none). Costs a float64 PyTorch run over each prompt.

    ``prepack``: the CPU session as the runtime loads it by default (True: ONNX Runtime packs each MatMul weight
    into a copy of its own) or with the weights read in place from the weights file (``Session(prepack=False)``:
    the same kernels on unpacked weights, one copy of the weights fewer beside the float64 model).
    """
    with torch_threads(threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 else 1):
        return _validate(export_dir, checkpoint, providers, steps, long, seed, threads, progress, heldout_bytes, budget, upstream, kv,
                         prepack=prepack)


def budgets_for(manifest: Manifest, budget=None) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """(the budgets an export is held to, the bounds set over edgelin's): edgelin's for the precision, then
    the export's own ``parity_budgets``, then ``budget`` (a mapping or ``KIND.BOUND=VALUE`` strings)."""
    given = parity.overrides_of(budget) if budget is None or isinstance(budget, (list, tuple)) else budget
    return parity.held(manifest.precision, manifest.extra.get("parity_budgets"), given)


def _validate(export_dir, checkpoint, providers, steps, long, seed, threads, progress, heldout_bytes=8192, budget=None,
              upstream="auto", kv=KV_LENGTHS, prepack=True) -> Report:
    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    requested = _parse_providers(providers)
    for name, value, low, high in (("steps", steps, 1, 100_000), ("long", long, 0, 1_000_000), ("threads", threads, 1, 256),
                                   ("seed", seed, 0, 2**63 - 1), ("heldout_bytes", heldout_bytes, 514, 1 << 24)):
        check_int(name, value, low=low, high=high, error=EdgelinError)
    if isinstance(kv, (str, bytes)) or not isinstance(kv, Sequence):
        raise EdgelinError(f"kv must be a list of prompt lengths, got {kv!r}")
    kv = [check_int("kv length", n, low=1, high=1 << 20, error=EdgelinError) for n in kv]
    export_dir = Path(export_dir)
    manifest = Manifest.load(export_dir)
    budgets, overrides = budgets_for(manifest, budget)
    in_memory = isinstance(checkpoint, torch.nn.Module)
    if in_memory:
        protocol.check_model(checkpoint)
        model, ckpt_path = checkpoint.float().eval(), None
    else:
        ckpt_path = open_checkpoint(_resolve_checkpoint(manifest, checkpoint))  # the folder read once: config, files, hash
        model = load_checkpoint(ckpt_path)
    chunk = manifest.extra.get("chunk_size")
    if isinstance(chunk, int) and hasattr(model, "with_chunk_size"):  # exported with --chunk-size
        model = model.with_chunk_size(chunk).eval()
    framework, no_upstream = _upstream_plan(upstream, ckpt_path)

    report = Report(str(export_dir), str(ckpt_path or "<in-memory model>"), manifest.precision, {},
                    strict_providers=providers != "auto", budgets=budgets, overrides=overrides, prepack=prepack)
    say("structure ...")
    for c in check_structure(export_dir, manifest, ckpt_path, model):
        report.checks.append(c)
    if in_memory:
        ok = model_sha256(checkpoint) == manifest.source
        report.checks.append(Check("structure", "source weights", PASS if ok else FAIL, where="" if ok else "model weights hash != manifest source"))

    try:
        # the hash check is a structure check of its own above: the numbers are still compared where the
        # files differ, to say where they diverge
        cpu = Session(export_dir, provider="cpu", threads=threads, check_hashes=False, prepack=prepack)
    except ManifestError as exc:
        report.checks.append(Check("structure", "runtime can load the export", FAIL, where=str(exc)))
        report.seconds = time.perf_counter() - t_start
        return report
    report.providers["cpu"] = "active"
    mismatch = _contract_mismatch(model, manifest)
    if mismatch:  # nothing can be compared: the numbers would be of two different models
        report.checks.append(Check("structure", "checkpoint's model <-> export", FAIL,
                                   where=f"{mismatch}: pass the checkpoint this export was made from"))
        report.seconds = time.perf_counter() - t_start
        return report
    v = _Validator(export_dir, model, manifest, budgets, seed, say, overrides)
    if v.quantised is not None:
        report.state_reference = quantref.arithmetic(manifest) or ""
    say("prefill vs PyTorch ...")
    v.prefill_vs_torch(cpu)
    say("decode vs PyTorch ...")
    v.decode_vs_torch(cpu, steps)
    say("prefill vs decode ...")
    v.graphs_agree(cpu)
    if manifest.lengths is not None:
        v.ragged_agrees(cpu)
    say("golden outputs ...")
    try:
        gold = golden.Golden.load(export_dir, manifest)
    except ManifestError as exc:
        gold = None
        v.add(Check("golden", "golden outputs (golden.json)", FAIL, where=str(exc)))
    if gold is not None:
        v.golden_outputs(cpu, gold)
    elif "golden" not in manifest.extra:
        v.add(Check("golden", "golden outputs (golden.json)", NA, where="this export has none (made by an earlier edgelin)"))
    plan = golden.plan_for(manifest.vocab_size, v.chunk, manifest.min_sequence, seed=seed, steps=steps,
                           max_positions=manifest.max_positions)  # the fixed inputs fit the declared context
    cpu_rows = golden.run_plan(cpu, plan) if len(requested) > 1 else None
    for name in requested:
        if name == "cpu":
            continue
        say(f"provider {name} ...")
        try:
            other = Session(export_dir, provider=name, threads=threads, check_hashes=False)
        except ProviderError as exc:
            report.providers[name] = f"not available: {exc}"
            v.add(Check("providers", f"{name} vs cpu", NA, where=f"not available: {exc}"))
            continue
        report.providers[name] = "active"
        v.provider_vs_cpu(cpu_rows, other, name, plan)
    if long:
        say(f"long stream: {long} decode steps vs float64 PyTorch ...")
        report.drift = v.long_stream(cpu, long)
    if manifest.grows and kv:
        say(f"KV cache after {', '.join(f'{n:,}' for n in kv)} tokens vs float64 PyTorch ...")
        v.kv_cache(cpu, kv)
    say("behaviour ...")
    v.behaviour(cpu, k=32)
    say(f"precision ({manifest.precision}) vs fp32 PyTorch: greedy agreement, held-out bits/byte ...")
    text = heldout_text(manifest)
    v.greedy_agreement(cpu, text)
    report.heldout = v.heldout(cpu, text, heldout_bytes)
    v.drop_model64()
    if framework is not None:
        report.upstream = v.upstream(cpu, ckpt_path, framework, steps, threads, required=upstream == "required")
    elif no_upstream:
        v.add(Check("upstream", "import and graphs vs the checkpoint's own framework", NA, where=no_upstream))
    report.checks.extend(v.checks)
    report.rounding_floor = {"logits": {"max_rel": v.floor["logits"].max_rel, "rel_l2": v.floor["logits"].rel_l2},
                             "state": {"rel_l2": v.floor["state"].rel_l2}, "factor": parity.FLOOR_FACTOR}
    if v.no_floor:
        report.rounding_floor["not_measured"] = v.no_floor
    if v.peer is not None:
        report.precision_floor = v.peer.record()
    report.seconds = time.perf_counter() - t_start
    return report


def _upstream_plan(mode: str, checkpoint: Path | None) -> tuple[str | None, str]:
    """(the framework to run, or None; why none runs, for the report: '' where nothing needs saying -- edgelin's own
    model, or an in-memory one, is the model validated). "required" that cannot be met is an EdgelinError here,
    before any check runs."""
    from edgelin import upstream

    upstream.check_mode(mode)
    if mode == "off":
        return None, ""
    framework = None if checkpoint is None else upstream.framework_of(checkpoint)
    if framework is None:
        why = ("the model was passed in memory" if checkpoint is None else "the checkpoint is edgelin's own model") + \
            ": there is no other framework's model to compare with"
        if mode == "required":
            raise EdgelinError(f"--upstream required: {why}; use --upstream auto or off")
        return None, ""  # nothing was left uncompared: the model validated is the model
    missing = upstream.unavailable(framework)
    if missing:
        if mode == "required":
            raise EdgelinError(f"--upstream required: {missing}")
        return None, f"not compared: {missing}"
    return framework, ""


def _parse_providers(providers: str | list[str]) -> list[str]:
    names = providers.split(",") if isinstance(providers, str) else list(providers)
    names = [n.strip().lower() for n in names if n.strip()]
    if names == ["auto"]:
        return ["cpu", "cuda"]
    bad = [n for n in names if n not in EXECUTION_PROVIDERS]
    if bad or not names:
        raise EdgelinError(f"providers must be a comma list of {', '.join(EXECUTION_PROVIDERS)} (or 'auto'), got {providers!r}")
    return ["cpu"] + [n for n in names if n != "cpu"]


__all__ = ["BUDGETS", "Check", "Report", "budgets_for", "check_structure", "validate"]
