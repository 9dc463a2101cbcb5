"""Golden outputs: what the PyTorch model computed at export time, stored beside the graphs (``golden.json``),
and the torch-free check of any execution provider against them (``edgelin check``).

The inputs are fixed by the export: two prompts of ``chunk + 5`` tokens, prefilled in two pieces
(``chunk + 1`` tokens -- across the chunk boundary -- then the rest, the state carried), then ``DECODE_STEPS``
tokens decoded one by one with the state fed back (random ids stored in the file: every runtime is fed the
same ids whatever it computes). For each compared logits row (prefill positions 0, chunk-1,
chunk and the last; every decode step; both prompts) the file holds the reference's ``top_k`` largest
logits with their ids, and three numbers of the whole row: its largest magnitude, its L2 norm and its
argmax. (The two prompts run as one batch of 2 here, one at a time in the JavaScript runtime: the rows are the
same, except in an int8 export, whose activation scales are per tensor, so its errors move a little with the
batch -- within the budget either way.) With a vocabulary of at most ``TOP_K`` entries the row is stored whole; the file stays well under
1 MB whatever the vocabulary.

How a row is compared (``row_errors``): the errors of the whole row cannot be computed from the stored
part, so the check computes *lower bounds* of them that the stored numbers determine exactly --
max abs >= max(max |got - ref| over the stored ids, | max|got| - max|ref| |) and
||got - ref|| >= max(||got - ref|| over the stored ids, | ||got|| - ||ref|| |) -- and holds those to the
export's logits budget. A correct graph (whole-row errors within budget) therefore always passes; a wrong
one fails wherever the difference reaches the largest logits or the row's scale. With the whole row stored
the bounds are the errors themselves.

Standard library, numpy and onnxruntime only (through ``Session``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgelin import parity
from edgelin.errors import ManifestError
from edgelin.runtime.files import read_regular
from edgelin.runtime.manifest import Manifest, absent

GOLDEN_FILE = "golden.json"
GOLDEN_FORMAT = "edgelin-golden/1"
TOP_K = 256  # logits stored per row (the whole row for a vocabulary of at most this many)
DECODE_STEPS = 8
BATCH = 2
SEED = 0
MAX_GOLDEN_BYTES = 8 << 20  # read limit; an export's file is ~0.1-0.2 MB
KINDS = ("logits", "provider")  # the budgets a golden file carries


# ---- the inputs: the same for the export (PyTorch) and every runtime -------------------------------------
@dataclass(frozen=True)
class Plan:
    prompt: np.ndarray  # int64 [BATCH, L]
    pieces: tuple[int, ...]  # prefill call lengths, summing to L
    positions: tuple[int, ...]  # prefill positions whose logits are compared
    decode: np.ndarray  # int64 [BATCH, steps]: fed one by one after the prompt

    @property
    def rows(self) -> list[tuple[str, int, int]]:
        """(graph, batch row, position or step) of every compared logits row, in file order."""
        n = len(self.prompt)
        out = [("prefill", b, p) for b in range(n) for p in self.positions]
        return out + [("decode", b, t) for b in range(n) for t in range(self.decode.shape[1])]


def plan_for(vocab: int, chunk: int, min_sequence: int = 1, *, seed: int = SEED, steps: int = DECODE_STEPS,
             max_positions: int | None = None) -> Plan:
    """The prompts, pieces, compared positions and ``steps`` decode ids of an export: random ids from ``seed``. A model
    that declares a context (``max_positions``) shorter than that gets a plan inside it: fewer decode steps, then a
    shorter prompt (one piece where two do not fit), so that its own export and check never pass its context."""
    second = max(4, min_sequence)
    first = max(chunk + 1, min_sequence)
    if max_positions is not None and first + second + steps > max_positions:
        steps = max(1, min(steps, max_positions // 4))
        room = max_positions - steps  # prompt tokens that fit
        if room < max(1, min_sequence):
            raise ValueError(f"a context of {max_positions} positions holds no prompt of min_sequence {min_sequence} and a decode step")
        second = max(1, min_sequence, min(second, room // 2))
        first = room - second
        if first < max(1, min_sequence):  # two pieces do not fit: one
            first, second = room, 0
    length = first + second
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, (BATCH, length), dtype=np.int64)
    decode = rng.integers(0, vocab, (BATCH, steps), dtype=np.int64)
    positions = tuple(sorted({0, min(max(chunk - 1, 0), length - 1), min(chunk, length - 1), length - 1}))
    return Plan(prompt, (first, second) if second else (first,), positions, decode)


# ---- the file --------------------------------------------------------------------------------------------
def summarise(row: np.ndarray, k: int = TOP_K) -> dict[str, Any]:
    """One logits row [V] -> its stored form: the k largest logits (descending) with their ids, and the
    whole row's largest magnitude, L2 norm and argmax."""
    row = np.asarray(row, dtype=np.float32)
    k = min(k, row.shape[-1])
    ids = np.argsort(-row, kind="stable")[:k]
    r64 = row.astype(np.float64)
    return {"ids": [int(i) for i in ids], "values": [float(v) for v in row[ids]], "absmax": float(np.abs(r64).max()),
            "l2": float(np.linalg.norm(r64)), "argmax": int(ids[0])}


def make_golden(plan: Plan, prefill_logits: np.ndarray, decode_logits: np.ndarray, precision: str,
                budgets: dict[str, dict[str, float]], floor: parity.Errors | None = None) -> dict[str, Any]:
    """The golden file's content: ``prefill_logits`` [BATCH, L, V] of the whole prompt from a fresh state and
    ``decode_logits`` [BATCH, steps, V] of ``plan.decode`` fed one by one after it; ``floor``: the model's fp32
    rounding on these inputs (fp32 vs float64 PyTorch), which ``budgets`` were raised to (``parity.floored``)."""
    rows = []
    for graph, b, at in plan.rows:
        src = prefill_logits[b, at] if graph == "prefill" else decode_logits[b, at]
        if not np.isfinite(src).all():
            raise ValueError(f"the reference's {graph} logits (row {b}, {at}) are not finite")
        rows.append({"graph": graph, "batch": b, "at": at, **summarise(src)})
    return {
        "format": GOLDEN_FORMAT, "precision": precision, "budgets": {k: dict(budgets[k]) for k in KINDS},
        "prompt": plan.prompt.tolist(), "pieces": list(plan.pieces), "positions": list(plan.positions),
        "decode": plan.decode.tolist(), "top_k": min(TOP_K, prefill_logits.shape[-1]), "rows": rows,
        **({} if floor is None else {"rounding_floor": {"max_rel": floor.max_rel, "rel_l2": floor.rel_l2, "factor": parity.FLOOR_FACTOR}}),
    }


def held_budgets(precision: str, parity_budgets: dict | None, floor: parity.Errors | None = None) -> dict[str, dict[str, float]]:
    """The budgets a golden file holds an export of ``precision`` to: edgelin's for the precision with the export's own
    bounds (the manifest's ``parity_budgets``, --budget) applied, each raised to the model's rounding ``floor`` on the
    golden inputs (fp32 PyTorch vs float64) except the bounds the export set. The exporter writes them; ``Golden.load``
    refuses a file whose budgets are looser than these."""
    held, kept = parity.held(precision, parity_budgets)
    return {kind: parity.floored(held[kind], floor, keep=kept.get(kind, {})) for kind in KINDS}


def golden_text(golden: dict[str, Any]) -> str:
    return json.dumps(golden, separators=(",", ":"), allow_nan=False) + "\n"


@dataclass(frozen=True)
class Golden:
    plan: Plan
    rows: list[dict[str, Any]]
    budgets: dict[str, dict[str, float]]
    precision: str
    floor: parity.Errors | None = None  # the model's fp32 rounding on the inputs (an earlier edgelin's file: None)

    @classmethod
    def load(cls, export_dir: str | Path, manifest: Manifest) -> "Golden | None":
        """The export's golden outputs, checked against the manifest's sha256; None for an export without
        them (made by an earlier edgelin). ManifestError for a file that is missing, changed or malformed."""
        entry = manifest.extra.get("golden")
        if entry is None:
            return None
        where = f"{Path(export_dir) / GOLDEN_FILE}"
        if not isinstance(entry, dict) or entry.get("file") != GOLDEN_FILE or not isinstance(entry.get("sha256"), str):
            raise ManifestError(f"edgelin.json's 'golden' entry is not {{'file': {GOLDEN_FILE!r}, 'sha256': ...}}; re-export the model")
        path = Path(export_dir) / GOLDEN_FILE
        if not path.is_file():
            raise ManifestError(f"{absent(path, GOLDEN_FILE, str(Path(export_dir)))}, named in edgelin.json; copy the whole export folder, or re-export the model")
        data = read_regular(path, MAX_GOLDEN_BYTES, "golden outputs file")
        if len(data) != entry.get("bytes"):
            raise ManifestError(f"{where} is {len(data):,} bytes but edgelin.json says {entry.get('bytes')}; copy the whole export folder again, or re-export the model")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ManifestError(f"{where} is not the file edgelin.json records (its sha256 differs: changed since the export); re-export the model")
        try:
            d = json.loads(data.decode("utf-8"))
            if d.get("format") != GOLDEN_FORMAT:
                raise ValueError(f"format {d.get('format')!r}, not {GOLDEN_FORMAT!r}")
            prompt = np.asarray(d["prompt"], dtype=np.int64)
            decode = np.asarray(d["decode"], dtype=np.int64)
            plan = Plan(prompt, tuple(int(p) for p in d["pieces"]), tuple(int(p) for p in d["positions"]), decode)
            if prompt.ndim != 2 or decode.ndim != 2 or not len(prompt) or len(prompt) != len(decode) or sum(plan.pieces) != prompt.shape[1] \
                    or min(plan.pieces, default=0) < max(1, manifest.min_sequence):
                raise ValueError("prompt, decode and pieces do not fit together")
            if not plan.positions or not all(0 <= p < prompt.shape[1] for p in plan.positions):
                raise ValueError("positions outside the prompt")
            if (prompt < 0).any() or (prompt >= manifest.vocab_size).any() or (decode < 0).any() or (decode >= manifest.vocab_size).any():
                raise ValueError("token ids outside the vocabulary")
            rows = d["rows"]
            if [(r["graph"], r["batch"], r["at"]) for r in rows] != plan.rows:
                raise ValueError("its rows are not the ones its plan compares")
            for r in rows:
                ids, values = np.asarray(r["ids"]), np.asarray(r["values"], dtype=np.float64)
                if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != len(values) or not len(ids) or (ids < 0).any() \
                        or (ids >= manifest.vocab_size).any() or len(set(ids.tolist())) != len(ids):
                    raise ValueError(f"row {r['graph']} {r['batch']}/{r['at']}: its ids are not distinct ids of the vocabulary, one per value")
                if not (np.isfinite(values).all() and all(isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] >= 0 for k in ("absmax", "l2"))):
                    raise ValueError(f"row {r['graph']} {r['batch']}/{r['at']}: non-finite or negative numbers")
            budgets = {k: {b: float(v) for b, v in d["budgets"][k].items()} for k in KINDS}
            if not all(math.isfinite(v) and v >= 0 for bounds in budgets.values() for v in bounds.values()):
                raise ValueError("budgets: non-finite or negative numbers")
            floor = None
            if "rounding_floor" in d:
                f = {k: float(d["rounding_floor"][k]) for k in ("max_rel", "rel_l2")}
                if not all(math.isfinite(v) and v >= 0 for v in f.values()):
                    raise ValueError("rounding_floor: non-finite or negative numbers")
                floor = parity.Errors(0.0, f["rel_l2"], 0, f["max_rel"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{where} is not a golden outputs file edgelin can read ({exc}); re-export the model") from None
        _agrees(where, d.get("precision"), budgets, floor, manifest)
        return cls(plan, rows, budgets, str(d.get("precision")), floor)


def _agrees(where: str, precision: Any, budgets: dict[str, dict[str, float]], floor: parity.Errors | None, manifest: Manifest) -> None:
    """A golden file is checked under its manifest: made for the export's precision, and holding it to no looser budgets
    than the manifest's precision and parity_budgets give (raised to the file's rounding floor, which only an fp32
    export measures). Another export's file (an int8 export's, in an fp32 export) or budgets edited to pass anything
    would otherwise pass a wrong graph."""
    if precision != manifest.precision:
        raise ManifestError(f"{where} was made for a {precision!r} export but edgelin.json says {manifest.precision!r} (another export's "
                            "golden outputs?); re-export the model")
    if floor is not None and manifest.precision != "fp32":
        raise ManifestError(f"{where} records a rounding floor, which only an fp32 export measures, in a {manifest.precision} export; "
                            "re-export the model")
    try:
        want = held_budgets(manifest.precision, manifest.extra.get("parity_budgets"), floor)
    except parity.ParityError as exc:
        raise ManifestError(f"edgelin.json: {exc}; re-export the model") from None
    for kind in KINDS:
        for bound, limit in want[kind].items():
            value = budgets[kind].get(bound, math.inf)  # a bound left out holds nothing
            if not value <= limit:
                raise ManifestError(f"{where} holds the export to {kind} {bound} <= {value:g}, looser than the {limit:g} that "
                                    f"edgelin.json's precision ({manifest.precision}) and budgets give (edited, or another export's); "
                                    "re-export the model")


# ---- running the plan and comparing -------------------------------------------------------------------------
def run_plan(session, plan: Plan) -> np.ndarray:
    """The plan's compared logits rows [rows, V] as ``session`` computes them (prefill in the plan's pieces,
    state carried, then decode with the state fed back), in ``plan.rows`` order."""
    state = session.new_state(len(plan.prompt))
    prefill, start = [], 0
    for n in plan.pieces:
        prefill.append(np.asarray(session.prefill(plan.prompt[:, start:start + n], state), dtype=np.float32))
        start += n
    prefill = np.concatenate(prefill, axis=1)
    decode = [np.asarray(session.decode(plan.decode[:, t:t + 1], state), dtype=np.float32)[:, 0] for t in range(plan.decode.shape[1])]
    out = []
    for graph, b, at in plan.rows:
        out.append(prefill[b, at] if graph == "prefill" else decode[at][b])
    return np.stack(out)


def row_errors(got: np.ndarray, row: dict[str, Any]) -> parity.Errors:
    """Lower bounds of the whole row's errors from its stored part (see the module docstring)."""
    got = np.asarray(got, dtype=np.float64)
    nonfinite = int(got.size - np.isfinite(got).sum())
    if nonfinite:
        return parity.Errors(math.inf, math.inf, nonfinite, math.inf)
    ids = np.asarray(row["ids"], dtype=np.int64)
    ref = np.asarray(row["values"], dtype=np.float64)
    diff = got[ids] - ref
    max_abs = max(float(np.abs(diff).max(initial=0.0)), abs(float(np.abs(got).max(initial=0.0)) - row["absmax"]))
    l2 = max(float(np.linalg.norm(diff)), abs(float(np.linalg.norm(got)) - row["l2"]))
    return parity.Errors(max_abs, l2 / max(row["l2"], 1e-30), 0, max_abs / max(row["absmax"], 1.0))


@dataclass
class Result:
    """One comparison of a provider: against the golden outputs or against the first provider."""
    group: str  # "golden" | "providers"
    name: str  # e.g. "prefill vs golden", "decode vs cpu"
    errors: parity.Errors
    budget: dict[str, float]
    where: str = ""  # the first row out of budget

    @property
    def passed(self) -> bool:
        return parity.within(self.errors, self.budget)


def _grouped(plan: Plan, per_row: list[parity.Errors], budget: dict[str, float], group: str, against: str) -> list[Result]:
    out = []
    for graph in ("prefill", "decode"):
        idx = [i for i, r in enumerate(plan.rows) if r[0] == graph]
        worst, where = parity.NONE, ""
        for i in idx:
            worst = worst.worst(per_row[i])
            if not where and not parity.within(per_row[i], budget):
                _, b, at = plan.rows[i]
                e = per_row[i]
                where = (f"{graph} {'position' if graph == 'prefill' else 'step'} {at} of prompt {b}: max abs {e.max_abs:.2e}, "
                         f"max rel {e.max_rel:.2e}, rel L2 {e.rel_l2:.2e}")
        name = f"{graph} vs {against}" + (f" ({plan.decode.shape[1]} steps)" if graph == "decode" else f" (pieces {'+'.join(map(str, plan.pieces))})")
        out.append(Result(group, name, worst, dict(budget), where))
    return out


def against_golden(got: np.ndarray, golden: Golden, budget: dict[str, float] | None = None) -> list[Result]:
    """``got`` (``run_plan``'s rows) against the golden rows, held to ``budget`` (default: the file's logits budget)."""
    bounds = golden.budgets["logits"] if budget is None else budget
    return _grouped(golden.plan, [row_errors(g, r) for g, r in zip(got, golden.rows)], bounds, "golden", "golden")


def against_provider(got: np.ndarray, ref: np.ndarray, plan: Plan, budget: dict[str, float], name: str) -> list[Result]:
    return _grouped(plan, [parity.errors(g, r) for g, r in zip(got, ref)], budget, "providers", name)


def decode_ms(session, plan: Plan, steps: int = 24) -> float:
    """Median ms of one decode step at batch 1 (after two warm-up steps), the state fed back."""
    state = session.new_state(1)
    prompt = plan.prompt[:1, :plan.pieces[-1]]  # a piece the plan prefills: at least min_sequence
    limit = session.manifest.max_positions
    if limit is not None:  # a declared context holds the prompt, the warm-up and the timed steps
        steps = max(1, min(steps, limit - prompt.shape[1] - 2))
    session.prefill(prompt, state)
    tok = plan.prompt[:1, :1]
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        session.decode(tok, state)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


# ---- the check of several providers ---------------------------------------------------------------------
@dataclass
class ProviderRun:
    name: str
    status: str  # "active" | "not available: why" | "failed: why" (an error while it ran the graphs)
    results: list[Result] = field(default_factory=list)
    decode_ms: float | None = None
    seconds: float = 0.0


@dataclass
class CheckReport:
    export_dir: str
    precision: str
    golden: bool  # the export has golden outputs
    runs: list[ProviderRun] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.status == "active" for r in self.runs) and all(x.passed for r in self.runs for x in r.results) and self.compared

    @property
    def compared(self) -> bool:
        return any(r.results for r in self.runs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "edgelin-check/1", "export_dir": self.export_dir, "precision": self.precision, "golden": self.golden,
            "passed": self.passed, "seconds": self.seconds,
            "providers": [{"name": r.name, "status": r.status, "decode_ms": r.decode_ms, "seconds": r.seconds,
                           "results": [{"group": x.group, "name": x.name, "max_abs": x.errors.max_abs, "max_rel": x.errors.max_rel,
                                        "rel_l2": x.errors.rel_l2, "nonfinite": x.errors.nonfinite, "budget": x.budget,
                                        "passed": x.passed, "where": x.where} for x in r.results]}
                          for r in self.runs],
        }

    def table(self) -> str:
        head = ("provider", "check", "max abs", "max rel", "rel L2", "budget", "result", "decode ms")
        rows = [head]
        notes = []
        for r in self.runs:
            if r.status != "active":
                rows.append((r.name, "-", "", "", "", "", "NOT AVAILABLE" if r.status.startswith("not available") else "FAILED", ""))
                notes.append(f"  {r.name}: {r.status}")
                continue
            for i, x in enumerate(r.results):
                budget = " ".join(f"{k}<={v:g}" for k, v in x.budget.items())
                rows.append((r.name, x.name, f"{x.errors.max_abs:.1e}", f"{x.errors.max_rel:.1e}", f"{x.errors.rel_l2:.1e}", budget,
                             "pass" if x.passed else "FAIL", f"{r.decode_ms:.3f}" if i == 0 and r.decode_ms is not None else ""))
                if x.where and not x.passed:
                    notes.append(f"  {r.name}/{x.name}: first out of budget at {x.where}")
            if not r.results:
                rows.append((r.name, "(nothing to compare)", "", "", "", "", "", f"{r.decode_ms:.3f}" if r.decode_ms is not None else ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines += notes
        if not self.golden:
            lines.append("this export has no golden outputs (golden.json; exports made by an earlier edgelin): only the providers were compared with each other")
        n = sum(len(r.results) for r in self.runs)
        bad = sum(not x.passed for r in self.runs for x in r.results)
        missing = [r.name for r in self.runs if r.status.startswith("not available")]
        broken = [r.name for r in self.runs if r.status.startswith("failed")]
        verdict = "PASS" if self.passed else "FAIL"
        tail = "".join([f" -- not available: {', '.join(missing)}" if missing else "", f" -- failed to run: {', '.join(broken)}" if broken else ""])
        tail = tail or ("" if self.compared else " -- nothing was compared")
        lines.append(f"{verdict}: {n - bad} of {n} comparisons within budget ({self.seconds:.1f} s){tail}")
        return "\n".join(lines)


def check(export_dir: str | Path, providers: list[str], *, threads: int | None = None, timing: bool = True,
          progress: Callable[[str], None] | None = None, open_session: Callable | None = None, prepack: bool = True) -> CheckReport:
    """Run the export's golden inputs on each provider (e.g. ["cpu", "openvino"]): each against the golden
    outputs, and each after the first against the first. A provider that cannot be activated is reported
    "not available" (the check then fails). ``open_session(export_dir, provider)`` makes the sessions
    (default: ``Session`` with ``threads`` and ``prepack``, ONNX Runtime's weight packing on the CPU)."""
    from edgelin.errors import ProviderError
    from edgelin.runtime.session import Session

    say = progress or (lambda _m: None)
    t_start = time.perf_counter()
    manifest = Manifest.load(export_dir)
    golden = Golden.load(export_dir, manifest)
    if golden is not None:
        plan, provider_budget = golden.plan, golden.budgets["provider"]
    else:
        chunk = int(manifest.extra.get("chunk_size", 64))
        plan = plan_for(manifest.vocab_size, chunk, manifest.min_sequence, max_positions=manifest.max_positions)
        provider_budget = parity.held(manifest.precision, manifest.extra.get("parity_budgets"))[0]["provider"]
    make = open_session or (lambda d, p: Session(d, provider=p, threads=threads, prepack=prepack))
    report = CheckReport(str(export_dir), manifest.precision, golden is not None)
    first = None
    for name in providers:
        say(f"{name} ...")
        t0 = time.perf_counter()
        try:
            session = make(export_dir, name)
        except ProviderError as exc:
            report.runs.append(ProviderRun(name, f"not available: {exc}"))
            continue
        run = ProviderRun(name, "active")
        try:
            got = run_plan(session, plan)
            if timing:
                run.decode_ms = decode_ms(session, plan)
        except Exception as exc:  # ONNX Runtime's errors while a provider runs a graph (Fail, RuntimeException, ...)
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            report.runs.append(ProviderRun(name, f"failed: ONNX Runtime raised {type(exc).__name__} running the graphs: {first_line[:300]}"))
            continue
        if golden is not None:
            run.results += against_golden(got, golden)
        if first is None:
            first = (name, got)
        else:
            run.results += against_provider(got, first[1], plan, provider_budget, first[0])
        run.seconds = time.perf_counter() - t0
        report.runs.append(run)
    report.seconds = time.perf_counter() - t_start
    return report


__all__ = [
    "BATCH", "DECODE_STEPS", "GOLDEN_FILE", "GOLDEN_FORMAT", "TOP_K", "CheckReport", "Golden", "Plan", "ProviderRun", "Result",
    "against_golden", "against_provider", "check", "make_golden", "plan_for", "row_errors", "run_plan", "summarise",
]
