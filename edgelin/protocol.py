"""The model protocol: what edgelin needs from a model to export, validate, generate and benchmark it.

Any ``torch.nn.Module`` that provides these members is exportable; no edgelin base class is required.
``edgelin.model.LinearLM`` is one implementation, the importers in ``edgelin.importers`` build others
from foreign checkpoints, and ``docs/your-model.md`` walks through writing one.

    vocab_size: int
    forward(input_ids [B, T] int64, state | None) -> (logits [B, T, vocab], state)   # the prefill graph
    step(input_ids [B, 1] int64, state) -> (logits [B, 1, vocab], state)             # the decode graph
    state_specs() -> tuple[StateSpec, ...]                                           # the state contract
    model_config() -> dict                                                           # the manifest's "model"

A state is a dict ``spec.key -> tensor`` ("{layer}.{name}" -> tensor); ``forward`` with ``state=None``
starts from ``fresh_state(model.state_specs(), batch)``. Optional members, used when present:
``chunk_size`` (the prefill graph's chunk: example inputs are made longer than it) and
``with_chunk_size(n)`` (the same weights with another chunk, for ``export --chunk-size``) and
``max_positions`` (the context limit it declares: the runtime refuses to go past it) and
``state_decays`` (True when every float state forgets its past at a decay < 1, so it stays bounded; only
such a model may store its state in float16, see ``check_float16_state``) and ``accepts_lengths`` (True
when ``forward(input_ids, state, lengths=lengths)`` prefills a right-padded ragged batch: lengths [B]
int64, row b's state afterwards exactly that of its first lengths[b] tokens alone; only then may
``export(..., ragged=True)`` give the prefill graph a ``lengths`` input, see ``check_lengths``) and
``accepts_logits_at`` (True when ``forward(input_ids, state, logits_at=at)`` computes the logits of the asked
positions only: at [B, P] int64, the result [B, P, vocab] equal to ``select_positions(forward(...)[0], at)``;
a model without it still gets the prefill graph's ``logits_at`` input, the head then computed for every
position and the rows picked afterwards).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from edgelin.errors import ExportError
from edgelin.runtime.manifest import StateSpec

DEFAULT_CHUNK = 64


@runtime_checkable
class ExportableModel(Protocol):
    vocab_size: int

    def forward(self, input_ids: torch.Tensor, state: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def step(self, input_ids: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def state_specs(self) -> tuple[StateSpec, ...]: ...

    def model_config(self) -> dict[str, Any]: ...


REQUIRED = ("vocab_size", "forward", "step", "state_specs", "model_config")


def check_model(model: Any) -> None:
    """Raise ExportError naming every protocol member ``model`` lacks, or a bad state contract."""
    if not isinstance(model, torch.nn.Module):
        raise ExportError(f"a model must be a torch.nn.Module, got {type(model).__name__}")
    missing = [name for name in REQUIRED if not hasattr(model, name)]
    if missing:
        raise ExportError(
            f"{type(model).__name__} does not implement the model protocol: it lacks {', '.join(missing)} "
            "(see docs/your-model.md)"
        )
    if not isinstance(model.vocab_size, int) or model.vocab_size < 1:
        raise ExportError(f"{type(model).__name__}.vocab_size must be a positive int, got {model.vocab_size!r}")
    specs = model.state_specs()
    if not all(isinstance(s, StateSpec) for s in specs):
        raise ExportError(f"{type(model).__name__}.state_specs() must return StateSpec objects (StateSpec.for_key)")
    keys = [s.key for s in specs]
    if len(set(keys)) != len(keys):
        raise ExportError(f"{type(model).__name__}.state_specs() has duplicate keys")


def chunk_size(model: Any) -> int:
    """The model's prefill chunk (example inputs must be longer than it), or a default."""
    value = getattr(model, "chunk_size", None)
    return value if isinstance(value, int) and value > 0 else DEFAULT_CHUNK


def _declares(model: Any, flag: str) -> bool:
    """An optional protocol flag: True only when the model sets it to True; absent means no."""
    return getattr(model, flag, False) is True


def state_decays(model: Any) -> bool:
    """Whether the model declares that its float states decay (stay bounded)."""
    return _declares(model, "state_decays")


# Why a running sum cannot live in float16 (docs/guide.md, "Edge precision"): float16 has an 11-bit
# significand, so once a sum holds ~2,048 tokens' worth of similar contributions, adding one more rounds
# to (nearly) nothing, and the sum passes float16's largest value, 65,504, after ~28k tokens of text for
# the previous bundled model, pydoc-linear, which had no decay (measured). A decayed state holds about
# 1 / (1 - gamma) tokens' worth instead.
def check_float16_state(model: Any) -> None:
    """Refuse a float16 state for a model whose state sums every token without decay."""
    if not state_decays(model):
        raise ExportError(
            f"{type(model).__name__} keeps running sums without decay: a float16 state would round away new "
            "tokens after ~2k tokens and overflow after ~28k; keep --state-dtype float32 (the default; weights "
            "and activations are fp16 anyway), or use a model whose state decays (state_decays = True)"
        )


def accepts_lengths(model: Any) -> bool:
    """Whether the model declares that ``forward`` takes per-row ``lengths`` (a ragged batch)."""
    return _declares(model, "accepts_lengths")


def check_lengths(model: Any) -> None:
    """Refuse a ragged prefill graph (``export --ragged``) for a model whose forward takes no lengths."""
    if not accepts_lengths(model):
        raise ExportError(
            f"{type(model).__name__} does not declare accepts_lengths = True (forward(ids, state, lengths=...)), so its "
            "prefill graph cannot take per-row lengths; export it without --ragged (the runtime then prefills "
            "prompts of different lengths one by one), or see docs/your-model.md"
        )


def accepts_logits_at(model: Any) -> bool:
    """Whether the model declares that ``forward`` computes the logits of chosen positions only (``logits_at``)."""
    return _declares(model, "accepts_logits_at")


def select_positions(x: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Rows ``at`` [B, P] (int64, each clamped into [0, T-1]: a graph cannot raise on data) of each sequence of
    ``x`` [B, T, D] -> [B, P, D]: the prefill graph's ``logits_at`` (the positions whose logits a caller wants)."""
    at = at.clamp(0, x.shape[1] - 1)  # [B, P]
    return torch.gather(x, 1, at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def max_positions(model: Any) -> int | None:
    """The context limit the model declares (optional member ``max_positions``: positions per sequence), or None."""
    value = getattr(model, "max_positions", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ExportError(f"{type(model).__name__}.max_positions must be a positive int or None, got {value!r}")
    return value


def tokenizer(model: Any) -> dict[str, Any]:
    """The manifest's tokenizer entry: the model's own, or bytes for a 256-token vocabulary."""
    own = getattr(model, "tokenizer", None)
    if isinstance(own, dict) and "kind" in own:
        return dict(own)
    return {"kind": "bytes"} if model.vocab_size == 256 else {"kind": "ids"}


__all__ = [
    "ExportableModel", "accepts_lengths", "accepts_logits_at", "select_positions", "max_positions", "check_float16_state", "check_lengths", "check_model", "chunk_size",
    "state_decays", "tokenizer",
]
