"""Linear attention in four forms with one signature:

    fn(q, k, v, *, feature_map, initial_state=None, chunk_size=64, eps=1e-6, normalize=True) -> (o, final_state)

- ``naive_linear_attention``: the textbook definition in a loop; the reference (use float64).
- ``chunk_linear_attention``: chunked parallel form, O(T), no loop over time; the prefill graph.
- ``recurrent_linear_attention`` / ``recurrent_step``: token by token; the decode graph.
- ``parallel_linear_attention``: the quadratic masked form; a benchmark baseline.

A per-step decay or gate (RetNet, GLA, Mamba2) would enter as one more optional input of each form and
one more multiplicative factor in the state update; the state dict and the graph contract stay as they are.
"""

from edgelin.ops.chunk import chunk_linear_attention
from edgelin.ops.common import State, init_state, state_layout, stable_divide
from edgelin.ops.naive import naive_linear_attention
from edgelin.ops.parallel import parallel_linear_attention
from edgelin.ops.recurrent import recurrent_linear_attention, recurrent_step

FORMS = {
    "naive": naive_linear_attention,
    "chunk": chunk_linear_attention,
    "recurrent": recurrent_linear_attention,
    "parallel": parallel_linear_attention,
    "step": recurrent_step,  # exactly one token: the decode graph
}

__all__ = [
    "FORMS",
    "State",
    "chunk_linear_attention",
    "init_state",
    "naive_linear_attention",
    "parallel_linear_attention",
    "recurrent_linear_attention",
    "recurrent_step",
    "stable_divide",
    "state_layout",
]
