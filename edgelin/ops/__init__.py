"""Linear attention in four forms with one signature:

    fn(q, k, v, *, feature_map, initial_state=None, chunk_size=64, eps=1e-6, normalize=True, g=None) -> (o, final_state)

- ``naive_linear_attention``: the textbook definition in a loop; the reference (use float64).
- ``chunk_linear_attention``: chunked parallel form, O(T), no loop over time; the prefill graph.
- ``recurrent_linear_attention`` / ``recurrent_step``: token by token; the decode graph.
- ``parallel_linear_attention``: the quadratic masked form; a benchmark baseline.

``g`` is an optional per-step log-decay (<= 0), [B, H, T] per head (RetNet's log gamma, Mamba2 / simple
GLA's data-dependent gate) or [B, H, T, F] per feature (GLA): S_t = exp(g_t) * S_{t-1} + phi(k_t) v_t^T,
and z likewise (see edgelin.ops.common). The state dict and the graph contract stay as they are; with
g=None every form runs exactly the undecayed code.
"""

from edgelin.ops.chunk import chunk_linear_attention
from edgelin.ops.common import State, check_decay, init_state, relative_log_decay, state_layout, stable_divide
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
    "check_decay",
    "chunk_linear_attention",
    "init_state",
    "naive_linear_attention",
    "parallel_linear_attention",
    "recurrent_linear_attention",
    "recurrent_step",
    "relative_log_decay",
    "stable_divide",
    "state_layout",
]
