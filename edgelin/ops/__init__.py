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

The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet) are in ``edgelin.ops.delta``, in the
forms naive / chunk / recurrent / step with their own signature ``fn(q, k, v, beta, *, g=None, initial_state=None,
chunk_size=64, scale=1.0, qk_l2norm=False, lengths=None)`` and state {"S": [B, H, K, V]} (``DELTA_FORMS``).

``lengths`` ([B] int64, right padding; accepted by the sequence forms naive, chunk and parallel) makes a
ragged batch: each row's output and final state are those of its first lengths[b] tokens alone
(edgelin.ops.lengths). None (the default) runs exactly the code without it.
"""

import torch

from edgelin.ops.chunk import chunk_linear_attention
from edgelin.ops.common import State, check_decay, init_state, relative_log_decay, state_layout, stable_divide
from edgelin.ops.delta import (
    DELTA_FORMS,
    DELTA_SEQUENCE_FORMS,
    chunk_delta_rule,
    chunk_states,
    delta_state_layout,
    delta_step,
    l2norm,
    naive_delta_rule,
    recurrent_delta_rule,
    unit_lower_inverse,
)
from edgelin.ops.naive import naive_linear_attention
from edgelin.ops.parallel import parallel_linear_attention
from edgelin.ops.recurrent import recurrent_linear_attention, recurrent_step

# The accuracy contract of the fast forms against the naive reference, as relative error
# max|fast - naive| / max|naive| per tensor (o and every state), by dtype. float32: every form sums up to ~500
# products of O(1) terms in another order than the reference (worst measured ~1e-6 at T = 500, decayed or
# not: a decay weight exp(L) only shrinks a term, and L is summed over its own window), so 1e-5 is ~10x that.
REFERENCE_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}

FORMS = {
    "naive": naive_linear_attention,
    "chunk": chunk_linear_attention,
    "recurrent": recurrent_linear_attention,
    "parallel": parallel_linear_attention,
    "step": recurrent_step,  # exactly one token: the decode graph
}
SEQUENCE_FORMS = ("naive", "chunk", "recurrent", "parallel")  # the forms that take any number of tokens

__all__ = [
    "DELTA_FORMS",
    "DELTA_SEQUENCE_FORMS",
    "FORMS",
    "REFERENCE_TOLERANCE",
    "SEQUENCE_FORMS",
    "State",
    "check_decay",
    "chunk_delta_rule",
    "chunk_linear_attention",
    "chunk_states",
    "delta_state_layout",
    "delta_step",
    "init_state",
    "l2norm",
    "naive_delta_rule",
    "naive_linear_attention",
    "parallel_linear_attention",
    "recurrent_delta_rule",
    "recurrent_linear_attention",
    "recurrent_step",
    "relative_log_decay",
    "stable_divide",
    "state_layout",
    "unit_lower_inverse",
]
