"""A mixture-of-experts MLP's math: routing, and the experts run on the tokens routed to them only.

Routing, per token (router logits l = W_r x [N, E]):

    scores   s = softmax(l) or sigmoid(l)                                    [N, E]
    choice   ids = top-k of (s + b) (b: a score-correction bias that only chooses, LFM2's expert_bias; else s)
    weights  w = s[ids]; renormalised w / (sum w + eps) if asked; times a routed scaling factor  [N, k]

Exact ties: eagerly torch.topk chooses (as transformers does, which calls it), and it may take any of the tied
experts; the graphs' ONNX TopK takes the lower index, as ``naive_route`` does. Only exactly equal scores differ.

The experts: y = sum over the chosen e of w_e * down_e(silu(gate_e x) * up_e(x)), in expert order (as transformers
adds them). ``expert_add`` is one expert's share: it runs the expert on the rows whose weight for it is not zero
and adds the weighted rows into ``out``. Eagerly it is the torch operator ``edgelin::expert_add``; in the graphs
``translation_table`` makes each call a small group of standard ONNX nodes (NonZero, GatherND, three MatMuls on
that expert's own constant weights, a ScatterND of out[rows] + y): the row count is data dependent inside it,
so an expert no token chose multiplies nothing, and a decode step reads only the chosen experts' weights. The
torch side keeps static shapes, so torch.export traces it. ``naive_moe`` is the reference: a loop over tokens and
their chosen experts (run it in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid")


def route(logits: torch.Tensor, k: int, *, scoring: str, bias: torch.Tensor | None = None, renormalise: bool = False,
          eps: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (ids [N, k] int64, weights [N, k]) as the module docstring says. Softmax in the
    logits' dtype (transformers computes it in float32, the model's dtype here)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    if bias is None:
        weights, ids = torch.topk(scores, k, dim=-1)
    else:
        ids = torch.topk(scores + bias, k, dim=-1).indices
        weights = torch.gather(scores, 1, ids)
    if renormalise:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + eps if eps else total)
    if scale != 1.0:
        weights = weights * scale
    return ids, weights


def dense_weights(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(ids, weights) [N, k] -> [N, E]: each token's weight per expert, zero where not chosen (ids are distinct)."""
    return torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype, device=weights.device).scatter(1, ids, weights)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with weights as nn.Linear holds them: gate, up [I, D], down [D, I]; x [n, D]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _expert_add(out, x, weight, gate, up, down):
    rows = weight.nonzero()[:, 0]  # the tokens routed to this expert
    if rows.numel() == 0:
        return out.clone()
    y = swiglu(x[rows], gate, up, down) * weight[rows, None]
    return out.index_add(0, rows, y)


@torch.library.custom_op("edgelin::expert_add", mutates_args=())
def expert_add(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """out [N, D] + (weight [N] * expert(x [N, D])) on the rows where weight != 0 only (the module docstring)."""
    return _expert_add(out, x, weight, gate, up, down).contiguous()


@expert_add.register_fake
def _(out, x, weight, gate, up, down):
    return out.new_empty(out.shape)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """x [N, D], the routing (ids, weights) [N, k] and ``experts`` (E modules with gate, up, down nn.Linear, in
    order) -> [N, D]: the weighted sum of each token's chosen experts, one ``expert_add`` per expert."""
    dense = dense_weights(ids, weights, len(experts))  # [N, E]
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        out = expert_add(out, x, dense[:, e], expert.gate.weight, expert.up.weight, expert.down.weight)
    return out


def naive_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """The reference of ``moe_experts``: per token, its chosen experts one by one, in expert order."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[n, j])):
            e = experts[int(ids[n, j])]
            out[n] += weights[n, j] * swiglu(x[n : n + 1], e.gate.weight, e.up.weight, e.down.weight)[0]
    return out


def naive_route(logits: torch.Tensor, k: int, *, scoring: str, bias: torch.Tensor | None = None, renormalise: bool = False,
                eps: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``route``, token by token: experts ranked by (choice score, then the lower index first)."""
    ids, weights = [], []
    for row in logits:
        scores = row.exp() / row.exp().sum() if scoring == "softmax" else 1 / (1 + (-row).exp())
        choose = scores if bias is None else scores + bias
        chosen = sorted(range(row.shape[0]), key=lambda e: (-float(choose[e]), e))[:k]
        w = scores[chosen]
        if renormalise:
            w = w / (w.sum() + eps)
        ids.append(torch.tensor(chosen))
        weights.append(w * scale)
    return torch.stack(ids), torch.stack(weights)


def translation_table() -> dict:
    """torch.onnx's ``custom_translation_table`` for ``expert_add``: per call, the rows routed to the expert
    (NonZero of its weight column), their inputs (GatherND), the expert's SwiGLU as MatMuls on its constant
    weights (transposed to [D, I] / [I, D] initializers by the exporter's constant folding), the weight, and
    out[rows] + y written back into ``out`` (ScatterND)."""
    from onnxscript import opset18 as op

    def expert_add_nodes(out, x, weight, gate, up, down):
        rows = op.Transpose(op.NonZero(weight), perm=[1, 0])  # [n, 1] int64
        xe = op.GatherND(x, rows)  # [n, D]
        g = op.MatMul(xe, op.Transpose(gate, perm=[1, 0]))
        h = op.Mul(op.Mul(g, op.Sigmoid(g)), op.MatMul(xe, op.Transpose(up, perm=[1, 0])))
        y = op.Mul(op.MatMul(h, op.Transpose(down, perm=[1, 0])), op.Unsqueeze(op.GatherND(weight, rows), [1]))
        # out[rows] += y as a plain ScatterND of out[rows] + y (the rows are distinct): ONNX Runtime's CPU kernel has
        # no float16 reduction "add", a copy it has for every type
        return op.ScatterND(out, rows, op.Add(op.GatherND(out, rows), y))

    return {torch.ops.edgelin.expert_add.default: expert_add_nodes}


__all__ = ["SCORINGS", "dense_weights", "expert_add", "moe_experts", "naive_moe", "naive_route", "route", "swiglu",
           "translation_table"]
