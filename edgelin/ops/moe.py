"""A mixture-of-experts MLP's math: routing, and the experts run on the tokens routed to them only.

Routing, per token (router logits l = W_r x [N, E]):

    scores   s = softmax(l) or sigmoid(l)                                    [N, E]
    choice   ids = top-k of (s + b) (b: a score-correction bias that only chooses, LFM2's expert_bias; else s)
    weights  w = s[ids]; renormalised w / (sum w + eps) if asked; times a routed scaling factor  [N, k]

Scoring "topk_softmax" (Granite's, Mixtral's): ids = top-k of l, w = softmax(l[ids]) over the k chosen (the same
experts and weights as softmax, then renormalise, computed as transformers does). Group-limited routing (Nemotron-H's,
DeepSeek-V3's; ``groups`` G > 1, ``top_groups`` < G): the E experts in G consecutive groups, each group scored by the
sum of its two best choice scores, and the choice made among the experts of the ``top_groups`` best groups only
(the others' choice scores -inf). The groups' ranking is a count of the scores above (``top_mask``: no TopK node, so
each MoE layer keeps one TopK, its choice).

Exact ties: eagerly torch.topk chooses (as transformers does, which calls it), and it may take any of the tied
experts; the graphs' ONNX TopK takes the lower index, as ``naive_route`` does. Only exactly equal scores differ.

The experts: y = sum over the chosen e of w_e * down_e(silu(gate_e x) * up_e(x)), in expert order (as transformers
adds them); non-gated experts (modules with up and down only: Nemotron-H's) compute down_e(relu(up_e x)^2) and run
through ``expert_add_relu2``, their own operator, lowered the same way with two MatMuls. ``expert_add`` is one
expert's share: it runs the expert on the rows whose weight for it is not zero and adds the weighted rows into
``out``. Eagerly it is the torch operator ``edgelin::expert_add``; in the graphs ``translation_table`` makes each call
a small group of standard ONNX nodes (NonZero, GatherND, three MatMuls on that expert's own constant weights, a
ScatterND of out[rows] + y): the row count is data dependent inside it, so an expert no token chose multiplies
nothing, and a decode step reads only the chosen experts' weights. The torch side keeps static shapes, so torch.export
traces it. ``naive_moe`` is the reference: a loop over tokens and their chosen experts (run it in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid", "topk_softmax")


def top_mask(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., m] -> bool [..., m]: the k largest along the last axis, an exact tie to the lower index (as ONNX TopK):
    entry i is kept where fewer than k entries beat it (greater, or equal at a lower index). [..., m, m] comparisons."""
    m = x.shape[-1]
    lower = torch.ones(m, m, dtype=torch.bool, device=x.device).tril(-1)  # [i, j]: j < i
    a, b = x.unsqueeze(-1), x.unsqueeze(-2)  # x_i, x_j
    beaten = (b > a) | ((b == a) & lower)
    return beaten.sum(dim=-1) < k


def group_limit(choice: torch.Tensor, groups: int, top_groups: int) -> torch.Tensor:
    """Choice scores [N, E] -> [N, E] with -inf outside each token's ``top_groups`` best of ``groups`` consecutive
    expert groups, a group scored by the sum of its two best choice scores (transformers' NemotronHTopkRouter)."""
    E = choice.shape[-1]
    grouped = choice.reshape(-1, groups, E // groups)  # [N, G, E / G]
    group_scores = torch.where(top_mask(grouped, 2), grouped, torch.zeros_like(grouped)).sum(dim=-1)  # [N, G]
    keep = top_mask(group_scores, top_groups)  # [N, G]
    return torch.where(keep.unsqueeze(-1), grouped, torch.full_like(grouped, float("-inf"))).reshape(-1, E)


def route(logits: torch.Tensor, k: int, *, scoring: str, bias: torch.Tensor | None = None, renormalise: bool = False,
          eps: float = 0.0, scale: float = 1.0, groups: int = 1, top_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (ids [N, k] int64, weights [N, k]) as the module docstring says. Softmax in the
    logits' dtype (transformers computes it in float32, the model's dtype here)."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    if scoring == "topk_softmax":
        if bias is not None or groups > 1:
            raise ValueError("scoring 'topk_softmax' takes no score bias and no groups")
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        return ids, weights * scale if scale != 1.0 else weights
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    if groups > 1 and top_groups < groups:
        ids = torch.topk(group_limit(scores if bias is None else scores + bias, groups, top_groups), k, dim=-1).indices
        weights = torch.gather(scores, 1, ids)
    elif bias is None:
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


def relu2_mlp(x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(relu(up x)^2) with weights as nn.Linear holds them: up [I, D], down [D, I]; x [n, D]."""
    return F.linear(torch.relu(F.linear(x, up)).square(), down)


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


def _expert_add_relu2(out, x, weight, up, down):
    rows = weight.nonzero()[:, 0]
    if rows.numel() == 0:
        return out.clone()
    return out.index_add(0, rows, relu2_mlp(x[rows], up, down) * weight[rows, None])


@torch.library.custom_op("edgelin::expert_add_relu2", mutates_args=())
def expert_add_relu2(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """out [N, D] + (weight [N] * down(relu(up x)^2)) on the rows where weight != 0 only: a non-gated expert's share."""
    return _expert_add_relu2(out, x, weight, up, down).contiguous()


@expert_add_relu2.register_fake
def _(out, x, weight, up, down):
    return out.new_empty(out.shape)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """x [N, D], the routing (ids, weights) [N, k] and ``experts`` (E modules with gate, up, down nn.Linear, or up
    and down only (relu^2), in order) -> [N, D]: the weighted sum of each token's chosen experts, one ``expert_add``
    (``expert_add_relu2``) per expert."""
    dense = dense_weights(ids, weights, len(experts))  # [N, E]
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        if not hasattr(expert, "gate"):
            out = expert_add_relu2(out, x, dense[:, e], expert.up.weight, expert.down.weight)
            continue
        out = expert_add(out, x, dense[:, e], expert.gate.weight, expert.up.weight, expert.down.weight)
    return out


def module_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """``moe_experts`` with each expert called as a module on its routed rows (what a module's hooks see: edgelin.quantref
    rounds a quantised linear's input there, as ONNX Runtime rounds the rows the graph gathers for that expert)."""
    dense = dense_weights(ids, weights, len(experts))  # [N, E]
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        rows = torch.nonzero(dense[:, e]).flatten()
        if rows.numel():
            out = out.index_add(0, rows, dense[rows, e, None] * expert(x[rows]))
    return out


def _expert(e, x: torch.Tensor) -> torch.Tensor:
    """One expert module on x [n, D] by the formula of its kind (gated SwiGLU, or relu^2 without a gate)."""
    if not hasattr(e, "gate"):
        return relu2_mlp(x, e.up.weight, e.down.weight)
    return swiglu(x, e.gate.weight, e.up.weight, e.down.weight)


def naive_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts) -> torch.Tensor:
    """The reference of ``moe_experts``: per token, its chosen experts one by one, in expert order."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in sorted(range(ids.shape[1]), key=lambda j: int(ids[n, j])):
            e = experts[int(ids[n, j])]
            out[n] += weights[n, j] * _expert(e, x[n : n + 1])[0]
    return out


def naive_route(logits: torch.Tensor, k: int, *, scoring: str, bias: torch.Tensor | None = None, renormalise: bool = False,
                eps: float = 0.0, scale: float = 1.0, groups: int = 1, top_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of ``route``, token by token: experts ranked by (choice score, then the lower index first);
    with groups, among the experts of the best groups only (groups ranked by their two best scores' sum, then index)."""
    ids, weights = [], []
    for row in logits:
        E = row.shape[0]
        if scoring == "topk_softmax":
            chosen = sorted(range(E), key=lambda e: (-float(row[e]), e))[:k]
            top = row[chosen]
            ids.append(torch.tensor(chosen))
            weights.append((top - top.max()).exp() / (top - top.max()).exp().sum() * scale)
            continue
        scores = row.exp() / row.exp().sum() if scoring == "softmax" else 1 / (1 + (-row).exp())
        choose = scores if bias is None else scores + bias
        candidates = list(range(E))
        if groups > 1 and top_groups < groups:
            m = E // groups
            best2 = [sum(sorted((float(choose[g * m + j]) for j in range(m)), reverse=True)[:2]) for g in range(groups)]
            kept = sorted(range(groups), key=lambda g: (-best2[g], g))[:top_groups]
            candidates = [e for e in candidates if e // m in kept]
        chosen = sorted(candidates, key=lambda e: (-float(choose[e]), e))[:k]
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
    out[rows] + y written back into ``out`` (ScatterND); ``expert_add_relu2`` likewise, with Relu, its square and two
    MatMuls."""
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

    def expert_add_relu2_nodes(out, x, weight, up, down):
        rows = op.Transpose(op.NonZero(weight), perm=[1, 0])
        xe = op.GatherND(x, rows)
        h = op.Relu(op.MatMul(xe, op.Transpose(up, perm=[1, 0])))
        y = op.Mul(op.MatMul(op.Mul(h, h), op.Transpose(down, perm=[1, 0])), op.Unsqueeze(op.GatherND(weight, rows), [1]))
        return op.ScatterND(out, rows, op.Add(op.GatherND(out, rows), y))

    return {torch.ops.edgelin.expert_add.default: expert_add_nodes,
            torch.ops.edgelin.expert_add_relu2.default: expert_add_relu2_nodes}


__all__ = ["SCORINGS", "dense_weights", "expert_add", "expert_add_relu2", "group_limit", "moe_experts", "module_experts", "naive_moe",
           "naive_route", "relu2_mlp", "route", "swiglu", "top_mask", "translation_table"]
