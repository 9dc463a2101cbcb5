"""A model as a graph: a torch module with flat tensor IO ``forward(input_ids, *states) -> (logits, *states)``,
plus everything torch.onnx needs to trace it (``graph_spec``): example inputs, IO names, dynamic dims.

IO names come from the model's state contract (``state_specs()``; each key K becomes input ``state.K``
and output ``present.K``), so the prefill graph, the decode graph and the manifest cannot disagree.
The model is anything that follows ``edgelin.protocol``.

A ragged prefill graph (``lengths=True``, for a model with ``accepts_lengths``) takes one more input after
``input_ids``: ``lengths`` int64 [batch], the real tokens of each right-padded row.

The product's prefill graph (``logits_at=True``) takes ``logits_at`` int64 [batch, positions] next (after
``lengths``, before the states): the positions whose logits it returns, [batch, positions, vocab]. A prompt
needs only its last position's, so the head -- the largest matmul of a small model with a large vocabulary --
runs on one row instead of T, and the graph returns 1 x V floats, not T x V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from edgelin import protocol
from edgelin.protocol import chunk_size
from edgelin.runtime.manifest import LOGITS_AT, PAST, POSITIONS  # logits_at: int64 [batch, positions]

INPUT_IDS = "input_ids"
LENGTHS = "lengths"  # the ragged prefill graph's per-row token counts, int64 [batch]
LOGITS = "logits"
ROLES = {"prefill": "forward", "decode": "step"}  # graph role -> the model method (form) it traces
EXAMPLE_BATCH = 2  # >= 2: a batch of 1 lets the exporter specialise the batch dim (docs/DESIGN.md, traps)
MAX_BATCH, MAX_SEQUENCE = 1 << 16, 1 << 24
EXAMPLE_PAST = 5  # positions in an example KV cache (the positions of its row differ: see edgelin.layers.attention)


def io_names(model: Any, lengths: bool = False, logits_at: bool = False) -> tuple[list[str], list[str]]:
    """(graph input names, graph output names), in graph order; ``lengths``: the ragged prefill graph's;
    ``logits_at``: a prefill graph that returns the logits of chosen positions."""
    specs = model.state_specs()
    return [INPUT_IDS] + [LENGTHS] * lengths + [LOGITS_AT] * logits_at + [s.input for s in specs], [LOGITS] + [s.output for s in specs]


def within_tokens(lengths: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``lengths`` [B] clamped to [0, T]: a graph cannot raise on data, so a client's out-of-range length
    means "none" (below 0) or "all" (above T) instead of a wrong conv window or an ONNX Runtime error."""
    return torch.minimum(lengths.clamp(min=0), torch.full_like(lengths, input_ids.shape[1]))  # [B]


class Graph(nn.Module):
    """``model`` run in one ``form``: "forward" (the prefill graph), "step" (the decode graph), or any
    other name, passed as ``model.forward(..., form=form)`` (e.g. LinearLM's quadratic "parallel" form,
    a benchmark baseline). ``lengths``: the first input after input_ids is the per-row lengths [B],
    passed as ``forward(..., lengths=...)`` (a ragged batch; not with "step"). ``logits_at``: the next input
    is the positions [B, P] whose logits are returned, passed to a model that ``accepts_logits_at``, else
    picked from its logits (``edgelin.protocol.select_positions``)."""

    def __init__(self, model: nn.Module, form: str = "forward", lengths: bool = False, logits_at: bool = False) -> None:
        super().__init__()
        if (lengths or logits_at) and form == "step":
            raise ValueError("the decode graph (form 'step') takes one token per row: no lengths, no logits_at")
        self.model, self.form, self.lengths, self.logits_at = model, form, lengths, logits_at
        self.keys = [s.key for s in model.state_specs()]
        self.own_pick = logits_at and protocol.accepts_logits_at(model)  # the model runs its head at those positions only

    def forward(self, input_ids: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ragged = {"lengths": within_tokens(inputs[0], input_ids)} if self.lengths else {}
        at = inputs[int(self.lengths)] if self.logits_at else None
        states = inputs[int(self.lengths) + int(self.logits_at):]
        state = dict(zip(self.keys, states))  # the graph's inputs are in spec order by construction
        pick = {"logits_at": at} if self.own_pick else {}
        if self.form == "forward":
            logits, new = self.model(input_ids, state, **ragged, **pick)
        elif self.form == "step":
            logits, new = self.model.step(input_ids, state)
        else:
            logits, new = self.model(input_ids, state, form=self.form, **ragged, **pick)
        if at is not None and not self.own_pick:
            logits = protocol.select_positions(logits, at)
        return (logits, *(new[key] for key in self.keys))


@dataclass
class GraphSpec:
    """What torch.onnx needs for one graph."""

    module: Graph
    example: tuple  # (input_ids, *states), or (input_ids, lengths, *states)
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple  # torch.export dynamic_shapes for ``example``


def example_positions(length: int) -> torch.Tensor:
    """An example ``logits_at`` [EXAMPLE_BATCH, 6] for an example prompt of ``length`` (>= 5) tokens: 6 positions (even,
    as example lengths are odd; neither batch 2 nor past 5, so no dim is traced as another one), in no order, the first
    and the last among them, one repeated: nothing is traced for "the last one only"."""
    return torch.tensor([[length - 1, 0, 3, length - 2, 3, 1]] * EXAMPLE_BATCH, dtype=torch.int64)


def graph_spec(model: nn.Module, role: str, form: str | None = None, *, lengths: bool = False, logits_at: bool = False) -> GraphSpec:
    """The export recipe of the ``role`` graph ("prefill" or "decode") of ``model``; ``lengths``: the
    prefill graph takes per-row lengths (a ragged batch; the model must accept them); ``logits_at``: the
    prefill graph returns the logits of the positions it is given (``Graph``).

    Examples are batch 2 and, for prefill, 2 chunks + 3 tokens: an example length below the chunk made
    a graph that failed in ONNX Runtime for longer inputs, with no export error (docs/DESIGN.md, traps).
    The example lengths differ between the rows (all T and one chunk less), so nothing is traced for
    one length.
    """
    if role not in ROLES:
        raise ValueError(f"graph role must be one of {', '.join(ROLES)}, got {role!r}")
    lengths, logits_at = lengths and role == "prefill", logits_at and role == "prefill"
    specs = model.state_specs()
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None else torch.float32
    # a growing state (a KV cache) gets EXAMPLE_PAST positions: a distinct size >= 2, nothing traced for 0 or 1
    state = {s.key: torch.full(s.concrete_shape(EXAMPLE_BATCH, EXAMPLE_PAST), s.init, dtype=torch.int64 if s.dtype == "int64" else dtype)
             for s in specs}
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    past = torch.export.Dim(PAST, min=0, max=MAX_SEQUENCE)
    # growing states of different windows (a window beside the whole context) hold different lengths: one dim each,
    # or ONNX Runtime, told they are one size, reuses one's buffer for the other
    windows = sorted({s.window or 0 for s in specs if PAST in s.shape})
    pasts = {w: past if w == 0 or len(windows) == 1 else torch.export.Dim(f"{PAST}_{w}", min=0, max=MAX_SEQUENCE) for w in windows}

    def state_dims(spec) -> dict:
        return {0: batch} | {i: pasts[spec.window or 0] for i, d in enumerate(spec.shape) if d == PAST}

    length = 1 if role == "decode" else 2 * chunk_size(model) + 3
    ids = torch.zeros(EXAMPLE_BATCH, length, dtype=torch.int64)
    id_dims = {0: batch} if role == "decode" else {0: batch, 1: torch.export.Dim("sequence", min=1, max=MAX_SEQUENCE)}
    inputs, outputs = io_names(model, lengths, logits_at)
    ragged = (torch.tensor([length, length - chunk_size(model)], dtype=torch.int64),) if lengths else ()
    at = (example_positions(length),) if logits_at else ()
    at_dims = ({0: batch, 1: torch.export.Dim(POSITIONS, min=1, max=MAX_SEQUENCE)},) * len(at)
    return GraphSpec(
        module=Graph(model, form or ROLES[role], lengths, logits_at).eval(),
        example=(ids, *ragged, *at, *(state[s.key] for s in specs)),
        input_names=inputs, output_names=outputs,
        # *inputs: lengths, logits_at, then states
        dynamic_shapes=(id_dims, (*({0: batch} for _ in ragged), *at_dims, *(state_dims(s) for s in specs))),
    )


__all__ = ["EXAMPLE_BATCH", "Graph", "GraphSpec", "INPUT_IDS", "LENGTHS", "LOGITS", "LOGITS_AT", "ROLES", "example_positions", "graph_spec", "io_names"]
