"""The checkpoint's own framework as the reference: is edgelin's import of a checkpoint the model its framework runs?

``edgelin validate`` compares the graphs with edgelin's PyTorch import of the checkpoint. For a foreign checkpoint
(transformers' Qwen3.5, LFM2, Mamba2, ...; fla's linear_attn, GLA, ...) that import is a re-implementation: a
config field read wrong would be in the import and in the graphs alike. This module runs the framework's own model
(``edgelin.upstream_run``, in a subprocess: what it hides or patches to run on a CPU stays there) on the same ids and
compares it with the import and with the graphs:

    framework_of(checkpoint)   -> "transformers" | "fla" | None (edgelin's own model: the import is the model)
    unavailable(framework)     -> why it cannot run here (not installed), or None
    run(checkpoint, ...)       -> Upstream: its prefill logits, cached decode logits, greedy ids, per-layer outputs
    precision_floor(...)       -> its own error at an export's precision (fp16) against its float64 run
    import_outputs(model, ...) -> the same quantities from edgelin's import
    first_departure(...)       -> the first layer whose output departs from the framework's, in words
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgelin import parity
from edgelin.errors import EdgelinError

MODES = ("off", "auto", "required")
GREEDY = 16  # greedy tokens compared
INSTALL = {
    "transformers": "pip install 'transformers==5.24.0' (the version edgelin's importers were checked against)",
    "fla": "pip install 'flash-linear-attention==0.6.0' 'fla-core==0.6.0' triton (its kernels run in Triton's interpreter on a CPU)",
}
WORKER = Path(__file__).with_name("upstream_run.py")


class UpstreamError(EdgelinError):
    """The framework's own model could not be run (it failed, timed out, or could not load every weight)."""


def framework_of(checkpoint: str | Path) -> str | None:
    """The framework a checkpoint folder's model comes from (by its config's ``model_type``), or None for edgelin's
    own checkpoints."""
    from edgelin.importers import FRAMEWORKS, foreign_model_type

    model_type = foreign_model_type(checkpoint)
    return None if model_type is None else FRAMEWORKS.get(model_type)


def unavailable(framework: str) -> str | None:
    """Why ``framework`` cannot run in this Python (a module it needs is missing, with the command that installs
    it), or None."""
    needs = {"transformers": ("transformers",), "fla": ("fla", "triton", "transformers")}[framework]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        return f"{framework} is not installed here (no module {missing[0]!r}); to compare with it: {INSTALL[framework]}"
    return None


# The framework's model in memory: its weights in the dtype it runs in, beside what loading them and running a short
# prompt take (the checkpoint's tensors as read, activations, the framework itself): the weights x FIT_MARGIN + FIT_BASE.
FIT_MARGIN = 1.2
FIT_BASE = 1 << 30
DTYPES = {"transformers": ("float64", "float32"), "fla": ("float32",)}  # the exact reference first; fla: float32 only here
DTYPE_BYTES = {"float64": 8, "float32": 4}


def parameter_count(checkpoint) -> int:
    """Values in a checkpoint's weight files (from their headers: nothing read but them)."""
    from edgelin.importers.folder import open_checkpoint
    from edgelin.streaming import value_counts

    return sum(count for _, _, count in value_counts(open_checkpoint(checkpoint).files))


def fitting_dtype(checkpoint, framework: str, available: int | None = None) -> tuple[str | None, str]:
    """(the dtype ``framework``'s own model can run in here, a note): its exact reference (transformers: float64) where
    that fits in the memory available now, else float32 where that fits (the note says why), else None (the note says
    what it needs and what is available). ``available``: bytes, default the machine's available memory now."""
    from edgelin.errors import CheckpointError
    from edgelin.runtime.memory import available_memory

    have = available_memory() if available is None else available
    try:
        count = parameter_count(checkpoint)
    except CheckpointError:  # no weights to read: the framework's run says what is wrong with the folder
        have = None
    if have is None:
        return DTYPES[framework][0], ""
    needs = {d: int(count * DTYPE_BYTES[d] * FIT_MARGIN) + FIT_BASE for d in DTYPES[framework]}
    fits = [d for d in DTYPES[framework] if needs[d] <= have]
    first = DTYPES[framework][0]
    said = ", ".join(f"{needs[d] / 1e9:.1f} GB in {d}" for d in DTYPES[framework])
    if not fits:
        return None, (f"{possessive(framework)} own model ({count / 1e9:.2f} B values) needs about {said}, and "
                      f"{have / 1e9:.1f} GB of memory are available")
    if fits[0] != first:
        return fits[0], (f"run in {fits[0]}, not {first}: in {first} {possessive(framework)} own model needs about "
                         f"{needs[first] / 1e9:.1f} GB and {have / 1e9:.1f} GB of memory are available")
    return first, ""


@dataclass
class Upstream:
    """What the framework's own model computed (numpy arrays)."""

    framework: str
    how: str
    model_class: str
    prefill: np.ndarray  # [B, T, V]
    decode: np.ndarray  # [N, B, V]
    greedy: np.ndarray  # [B, k] greedy ids continuing each row after the prompt and the steps
    hidden: list[np.ndarray]  # per layer [B, T, d]: the output of each decoder layer over the prompt
    seconds: dict[str, float] = field(default_factory=dict)


def run(checkpoint: str | Path, framework: str, prompt: np.ndarray, steps: np.ndarray, *, greedy: int = GREEDY,
        threads: int = 1, timeout: float = 3600.0, dtype: str = "float64") -> Upstream:
    """Run ``checkpoint`` with ``framework``'s own model on CPU in a subprocess: a prefill of ``prompt`` [B, T], then
    each column of ``steps`` [B, N] through its cache, then ``greedy`` greedy tokens through the same cache.
    ``dtype``: transformers' model in float64 (the exact reference) or "float16" (as a user runs it at half precision)."""
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory(prefix="edgelin-upstream-") as tmp:
        out = Path(tmp) / "upstream.safetensors"
        spec = {"framework": framework, "checkpoint": str(Path(checkpoint).resolve()), "prompt": prompt.tolist(),
                "steps": steps.tolist(), "greedy": int(greedy), "threads": int(threads), "out": str(out), "dtype": dtype}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        env = dict(os.environ)
        if framework == "fla":
            env["TRITON_INTERPRET"] = "1"  # chosen when a kernel is defined: before fla is imported
        t0 = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, str(WORKER), str(Path(tmp) / "spec.json")], capture_output=True, text=True,
                                  timeout=timeout, env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UpstreamError(f"{possessive(framework)} own model did not finish within {timeout:.0f} s; lower --steps or use --upstream off") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            raise UpstreamError(f"{possessive(framework)} own model failed on this checkpoint: {lines[-1] if lines else f'exit {done.returncode}'}")
        arrays = load_file(str(out))
        info = json.loads(Path(str(out) + ".json").read_text(encoding="utf-8"))
    seconds = {**info["seconds"], "total": time.perf_counter() - t0}
    hidden = [arrays[f"hidden.{i}"] for i in range(int(info["layers"]))]
    return Upstream(framework, info["how"], info["model_class"], arrays["prefill"], arrays["decode"], arrays["greedy"], hidden, seconds)


# The precision floor. At fp16 the error an export may have depends on the model as fp32's does (edgelin.parity's
# rounding floor): a Qwen3.5 whose logits reach 40 moves further under fp16 rounding than the bundled model, on which
# the fp16 budget was set. Where the framework a checkpoint came from runs the model in half precision itself, an fp16
# export is held to at most PRECISION_FACTOR x that run's error against the framework's float64 run, on the same ids,
# where that is above edgelin's budget: no worse than the framework the model came from at the same precision.
# Measured (the bench's hidden-256 checkpoints, 2 x 67 tokens and 4 decode steps; scripts/precision_floor.py,
# docs/bench/precision_floor.json): edgelin's fp16 graphs are 0.5-0.9x transformers' own fp16 error (max rel) in the
# Mamba2 and short-conv families, about level in the Gated DeltaNet ones (1.07x, 1.27x; Qwen3.5 0.85x on the smoke
# check's ids). The factor is 1, on the same ids, so that a defect somewhat worse than transformers' fp16 is still
# refused (a Mamba2's log-decays left in fp16: max rel 9.2e-3 against transformers' 6.6e-3); a max is noisy, so a
# correct export may be refused by it now and then: the message names both numbers.
PRECISION_FACTOR = 1.0
PRECISION_DTYPES = {"fp16": "float16"}  # export precision -> the framework's dtype for its run at that precision
PRECISION_FRAMEWORKS = ("transformers",)  # fla's models run in float32 only here (Triton's interpreter)


@dataclass(frozen=True)
class PrecisionFloor:
    """The framework's own logits at an export's precision against its float64 logits on the same ids."""

    framework: str
    dtype: str
    errors: parity.Errors
    tokens: tuple[int, int, int]  # batch, prompt tokens, decode steps

    def record(self) -> dict:
        """The manifest's ``precision_floor`` entry (validate holds the export to the same)."""
        return {"framework": self.framework, "dtype": self.dtype, "max_rel": self.errors.max_rel, "rel_l2": self.errors.rel_l2,
                "factor": PRECISION_FACTOR, "batch_prompt_steps": list(self.tokens)}

    @staticmethod
    def from_record(entry) -> "PrecisionFloor | None":
        """The manifest's entry read back; None where there is none or it is not one (then nothing is raised)."""
        numbers = [entry.get(k) for k in ("max_rel", "rel_l2")] if isinstance(entry, dict) else []
        if len(numbers) != 2 or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in numbers):
            return None
        return PrecisionFloor(str(entry.get("framework")), str(entry.get("dtype")), parity.Errors(0.0, float(numbers[1]), 0, float(numbers[0])),
                              tuple(entry.get("batch_prompt_steps") or (0, 0, 0)))

    def said(self) -> str:
        return f"{possessive(self.framework)} own model in {self.dtype} is {self.errors.max_rel:.1e} / {self.errors.rel_l2:.1e} from its float64 run"


def possessive(name: str) -> str:
    return name + ("'" if name.endswith("s") else "'s")


def precision_floor(checkpoint: str | Path, framework: str, precision: str, prompt: np.ndarray, steps: np.ndarray, *,
                    threads: int = 1, timeout: float = 3600.0) -> PrecisionFloor | None:
    """The framework's own logits at ``precision`` against its float64 logits, the worse of a prefill of ``prompt``
    [B, T] and the decode of each column of ``steps`` [B, N] through its cache (one subprocess run each); None where it
    has no such run (fla, int8, int4). UpstreamError if a run fails."""
    dtype = PRECISION_DTYPES.get(precision)
    if dtype is None or framework not in PRECISION_FRAMEWORKS:
        return None
    half = run(checkpoint, framework, prompt, steps, greedy=0, threads=threads, timeout=timeout, dtype=dtype)
    exact = run(checkpoint, framework, prompt, steps, greedy=0, threads=threads, timeout=timeout)
    worst = parity.errors(half.prefill, exact.prefill)
    for got, ref in zip(half.decode, exact.decode):
        worst = worst.worst(parity.errors(got, ref))
    return PrecisionFloor(framework, dtype, worst, (int(prompt.shape[0]), int(prompt.shape[1]), int(steps.shape[1])))


def import_outputs(model, prompt: np.ndarray, steps: np.ndarray, greedy: int):
    """edgelin's import on the same ids, in float32 PyTorch: (prefill logits [B, T, V], decode logits [N, B, V],
    greedy ids [B, k] after them, each layer's output over the prompt [B, T, d])."""
    import torch

    hidden: dict[int, np.ndarray] = {}

    def keep(i):
        def hook(_module, _inputs, output):
            hidden[i] = output[0].detach().float().numpy().copy()
        return hook

    handles = [block.register_forward_hook(keep(i)) for i, block in enumerate(model.blocks)] if hasattr(model, "blocks") else []
    try:
        with torch.no_grad():
            logits, state = model(torch.from_numpy(prompt))
    finally:
        for h in handles:
            h.remove()
    decoded = []

    def step(ids: np.ndarray) -> np.ndarray:
        nonlocal state
        with torch.no_grad():
            out, state = model.step(torch.from_numpy(ids), state)
        return out[:, -1].numpy()

    decoded = [step(steps[:, s : s + 1]) for s in range(steps.shape[1])]
    decode = np.stack(decoded) if decoded else np.zeros((0, logits.shape[0], logits.shape[-1]), np.float32)
    ids = greedy_ids(decoded[-1] if decoded else logits[:, -1].numpy(), step, greedy)
    return logits.numpy(), decode, ids, [hidden[i] for i in sorted(hidden)]


def greedy_ids(logits: np.ndarray, step, k: int) -> np.ndarray:
    """[B, k] greedy ids: ``logits`` [B, V] the last logits, ``step(ids [B, 1]) -> logits [B, V]`` for each next."""
    ids = np.zeros((logits.shape[0], k), dtype=np.int64)
    for t in range(k):
        ids[:, t] = logits.argmax(-1)
        if t + 1 < k:
            logits = step(ids[:, t : t + 1])
    return ids


def greedy_agreement(got: np.ndarray, ref: np.ndarray) -> tuple[float, str]:
    """(mean fraction of the k greedy ids before a row's first difference, the first difference in words or '')."""
    same = np.cumprod(got == ref, axis=1).sum(1)  # [B]
    k = ref.shape[1]
    first = next((b for b in range(len(same)) if same[b] < k), None)
    where = "" if first is None else f"row {first}: first different token at {int(same[first])} ({int(got[first, same[first]])} vs {int(ref[first, same[first]])})"
    return float(same.mean() / max(k, 1)), where


def first_departure(model, mine: list[np.ndarray], theirs: list[np.ndarray], bound: float) -> str:
    """The first layer whose output over the prompt departs from the framework's (relative L2 above ``bound``), in
    words; or, where every layer agrees, that the final norm or the head departs."""
    if len(mine) != len(theirs):
        return f"the import has {len(mine)} layers, the framework {len(theirs)}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(mine, theirs)):
        e = parity.errors(a, b)
        if not e.rel_l2 <= bound:
            kind = getattr(model.blocks[i].attn, "kind", "") if hasattr(model, "blocks") else ""
            before = "" if i == 0 else f"; layer{'s 0-' if i > 1 else ' '}{i - 1} agree{'s' if i == 1 else ''} (rel L2 <= {worst:.1e})"
            return f"first departs at layer {i}{f' ({kind})' if kind else ''}: its output's rel L2 {e.rel_l2:.2e}{before}"
        worst = max(worst, e.rel_l2)
    return f"every layer's output agrees (rel L2 <= {worst:.1e}): the final norm or the LM head departs"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise EdgelinError(f"upstream must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


__all__ = ["GREEDY", "MODES", "Upstream", "UpstreamError", "check_mode", "first_departure", "framework_of", "greedy_agreement", "greedy_ids",
           "import_outputs", "run", "unavailable"]
