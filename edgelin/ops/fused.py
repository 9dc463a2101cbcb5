"""The fused lowering: linear attention's recurrence as ONNX Runtime's ``com.microsoft.LinearAttention`` node.

``edgelin export --ops fused`` (``export(..., ops="fused")``) traces the graphs with ``lowering("fused")``
active. Inside it, the state update of every linear-attention form the graphs use -- ``recurrent_step`` and
``delta_step`` (the decode graph), ``chunk_linear_attention`` and ``chunk_delta_rule`` (the prefill graph) --
calls the torch operator ``edgelin::linear_attention`` instead of its portable code, and the exporter
translates that operator into one ``com.microsoft.LinearAttention`` node (ONNX Runtime >= 1.30 on CPU, onnxruntime-node and
onnxruntime-web's WASM backend). Two smaller pieces go the same way: each short causal convolution with a carried
window (``causal_conv``: ``edgelin::causal_conv`` -> one ``com.microsoft.CausalConvWithState`` node) and softplus
(``softplus``: ``edgelin::softplus`` -> one ``Softplus`` node, not torch's Softplus + Greater + Where). Everything
else around them (projections, feature maps, gates) is unchanged.

The block around the mixers goes the same way. A residual add and the RMSNorm after it (``x + h``, then
x / sqrt(mean(x^2) + eps) * w) are one ``com.microsoft.SkipSimplifiedLayerNormalization`` node
(``skip_rms_norm``: ``edgelin::skip_rms_norm``, the norm and the sum both out), across the block boundary too
(edgelin.skeleton defers each block's last add to the next norm). A softmax-attention decode step (T = 1) is one
``com.microsoft.GroupQueryAttention`` node (``group_query_attention``): the cache concatenation, the grouped
scores, edgelin's mask rule (as the node's additive ``attention_bias``: 0 where a slot is seen, -inf elsewhere,
so left-padded rows and windows keep their meaning), the softmax and the weighted values; RoPE, the q/k norms and
the output gate stay outside, and the KV cache keeps the portable layout ([B, H_kv, P, D], right-aligned), so the
state contract is the portable export's. That step's RoPE on q and on k is one ``com.microsoft.RotaryEmbedding`` node each
(``rotary_embedding``): its angle table is the step's own rows (one per batch row and position, ids 0 .. B T - 1), so
each row's positions are its own. The node's ``seqlens_k`` is P + T - 1 for every row and its
``total_sequence_length`` P + T: it reads the whole cache, and the bias masks what a row has not seen. Its prefill
form (T > 1 with a past) takes batch 1 only in ONNX Runtime, so the prefill graph keeps portable attention.

The operator's recurrence, per head (state [B, H, d_k, d_v], key-major as edgelin's):

    linear       S_t = S_{t-1} + k_t v_t^T
    gated        S_t = exp(g_t) S_{t-1} + k_t v_t^T              g per head [B, T, H] or per key feature [B, T, H d_k]
    delta        S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
    gated_delta  S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = scale q_t^T S_t                                      (edgelin passes scale 1: q is scaled before)

The state contract does not change: a fused export has the portable export's state names, shapes and
layout, so either graph pair continues the other's state, and every runtime drives both the same way. The
denominator of normalised linear attention (z_t = exp(g_t) z_{t-1} + phi(k_t), o = q^T S / (q^T z + eps)) rides
in the same node as one more value column: v' = [v | 1] and S' = [S | z], so q^T S' = [q^T S | q^T z].

What it cannot express stays portable: a ragged prefill (per-row lengths) runs the portable chunk form.

Eager PyTorch runs the operator's own recurrence (``_reference``: token by token, as the node is specified), so
``model.step`` under ``lowering("fused")`` computes what the fused graph computes; the tests hold it to the
portable forms in float64 and the graphs to both.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from edgelin.ops.common import State, advance, padded_denominator

LOWERINGS = ("portable", "fused")  # the graphs' lowering: ONNX standard operators only, or the fused node
DEFAULT_LOWERING = "portable"
MS_DOMAIN = "com.microsoft"
RULES = ("linear", "gated", "delta", "gated_delta")

_active = threading.local()


@contextlib.contextmanager
def lowering(name: str) -> Iterator[None]:
    """Within the block, the linear-attention forms lower to ``name`` ("portable" or "fused")."""
    if name not in LOWERINGS:
        raise ValueError(f"lowering must be one of {', '.join(LOWERINGS)}, got {name!r}")
    before = getattr(_active, "name", DEFAULT_LOWERING)
    _active.name = name
    try:
        yield
    finally:
        _active.name = before


def active() -> bool:
    """True while ``lowering("fused")`` is in effect."""
    return getattr(_active, "name", DEFAULT_LOWERING) == "fused"


# ---- the operator ------------------------------------------------------------------------------------
def _reference(q, k, v, past, decay, beta, rule: str, heads: int, scale: float):
    """com.microsoft.LinearAttention as specified, token by token: q, k [B, T, H d_k], v [B, T, H d_v], past
    [B, H, d_k, d_v], decay [B, T, H] or [B, T, H d_k] (log-space), beta [B, T, H] -> o [B, T, H d_v], S."""
    B, T, _ = q.shape
    dk, dv = past.shape[2], past.shape[3]
    qh, kh, vh = q.view(B, T, heads, dk), k.view(B, T, heads, dk), v.view(B, T, heads, dv)
    S, outs = past, []
    for t in range(T):
        if decay is not None:
            a = decay[:, t].exp()  # [B, H] (per head) or [B, H d_k] (per key feature)
            S = a.view(B, heads, -1, 1) * S  # the rows of S
        kt, vt = kh[:, t, :, :, None], vh[:, t, :, None, :]  # [B, H, d_k, 1], [B, H, 1, d_v]
        if rule in ("delta", "gated_delta"):
            vt = beta[:, t, :, None, None] * (vt - (kt * S).sum(2, keepdim=True))  # [B, H, 1, d_v]
        S = S + kt * vt
        outs.append(scale * (qh[:, t, :, :, None] * S).sum(2))  # [B, H, d_v]
    return torch.stack(outs, 1).reshape(B, T, heads * dv), S


@torch.library.custom_op("edgelin::linear_attention", mutates_args=())
def linear_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: torch.Tensor, decay: Optional[torch.Tensor],
    beta: Optional[torch.Tensor], rule: str, heads: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, S = _reference(q, k, v, past, decay, beta, rule, heads, scale)
    return o.contiguous(), S.contiguous()


@linear_attention_op.register_fake
def _(q, k, v, past, decay, beta, rule, heads, scale):
    B, T, _ = q.shape
    return q.new_empty(B, T, heads * past.shape[3]), past.new_empty(past.shape)


def _conv_reference(x, weight, bias, past, channels_last: bool, silu: bool):
    """com.microsoft.CausalConvWithState as specified (one spatial axis, dilation 1, no state window): a depthwise
    convolution of [past | x] along time with kernel weight [C, 1, K], then SiLU if ``silu``; the present state
    is the last K - 1 positions of [past | x]. Channels first: x [B, C, T], past [B, C, K - 1]; ``channels_last``:
    x [B, T, C], past [B, K - 1, C]. -> (y like x, present like past)."""
    if channels_last:
        x, past = x.transpose(1, 2), past.transpose(1, 2)
    full = torch.cat([past, x], dim=2)  # [B, C, K - 1 + T]
    y = F.conv1d(full, weight, bias, groups=weight.shape[0])  # [B, C, T]
    if silu:
        y = F.silu(y)
    present = full[:, :, x.shape[2]:]  # the last K - 1 positions
    if channels_last:
        y, present = y.transpose(1, 2), present.transpose(1, 2)
    return y, present


@torch.library.custom_op("edgelin::causal_conv", mutates_args=())
def causal_conv_op(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], past: torch.Tensor, channels_last: bool, silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, present = _conv_reference(x, weight, bias, past, channels_last, silu)
    return y.contiguous(), present.contiguous()


@causal_conv_op.register_fake
def _(x, weight, bias, past, channels_last, silu):
    return x.new_empty(x.shape), past.new_empty(past.shape)


@torch.library.custom_op("edgelin::softplus", mutates_args=())
def softplus_op(x: torch.Tensor) -> torch.Tensor:
    """log(1 + e^x) as ONNX's Softplus node (ONNX Runtime computes it without overflow: x + log1p(e^-x) above 0).
    Eager: torch's softplus (x itself above 20, where the two agree to float32 rounding)."""
    return F.softplus(x)


@softplus_op.register_fake
def _(x):
    return x.new_empty(x.shape)


def _skip_rms_norm_reference(x, skip, weight, eps: float):
    """s = x + skip; (s / sqrt(mean(s^2) + eps) * weight, s) over the last dim: the portable RMSNorm's arithmetic."""
    s = x + skip
    return s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight, s


@torch.library.custom_op("edgelin::skip_rms_norm", mutates_args=())
def skip_rms_norm_op(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = _skip_rms_norm_reference(x, skip, weight, eps)
    return y.contiguous(), s.contiguous()


@skip_rms_norm_op.register_fake
def _(x, skip, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _gqa_reference(q, k, v, past_key, past_value, bias, heads: int, kv_heads: int, scale: float):
    """com.microsoft.GroupQueryAttention as edgelin drives it (no rotary, the whole cache read, an additive bias):
    q [B, T, H D], k, v [B, T, H_kv D], past_key / past_value [B, H_kv, P, D], bias [B, 1, T, P + T] ->
    (o [B, T, H D], present_key, present_value [B, H_kv, P + T, D]); query head h reads key/value head h // (H / H_kv)."""
    B, T, _ = q.shape
    D = past_key.shape[3]
    keys = torch.cat([past_key, k.view(B, T, kv_heads, D).transpose(1, 2)], dim=2)  # [B, H_kv, P + T, D]
    values = torch.cat([past_value, v.view(B, T, kv_heads, D).transpose(1, 2)], dim=2)
    G = heads // kv_heads
    qh = q.view(B, T, kv_heads, G, D).permute(0, 2, 3, 1, 4)  # [B, H_kv, G, T, D]
    scores = (qh @ keys[:, :, None].transpose(3, 4)) * scale + bias[:, :, None]  # [B, H_kv, G, T, P + T]
    o = torch.softmax(scores, dim=-1) @ values[:, :, None]  # [B, H_kv, G, T, D]
    return o.permute(0, 3, 1, 2, 4).reshape(B, T, heads * D), keys, values


@torch.library.custom_op("edgelin::group_query_attention", mutates_args=())
def group_query_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, bias: torch.Tensor,
    heads: int, kv_heads: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o, keys, values = _gqa_reference(q, k, v, past_key, past_value, bias, heads, kv_heads, scale)
    return o.contiguous(), keys.contiguous(), values.contiguous()


@group_query_attention_op.register_fake
def _(q, k, v, past_key, past_value, bias, heads, kv_heads, scale):
    B, T, _ = q.shape
    size = (B, past_key.shape[1], past_key.shape[2] + T, past_key.shape[3])
    return q.new_empty(q.shape), past_key.new_empty(size), past_value.new_empty(size)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by halves (GPT-NeoX's rotate_half) on the first 2 r features of x [.., T, D] with cos, sin [.., T, r]
    broadcast over x's other dims; the rest of each head passes unchanged. The portable graphs' RoPE, and the reference of
    the fused node."""
    r = 2 * cos.shape[-1]
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)  # [.., T, r / 2] each
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [.., T, r]
    return out if rest is None else torch.cat([out, rest], dim=-1)


@torch.library.custom_op("edgelin::rotary_embedding", mutates_args=())
def rotary_embedding_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] rotated by halves at each (row, position)'s angles: cos, sin [B, T, r / 2] (``rotate_halves``)."""
    return rotate_halves(x, cos[:, None], sin[:, None]).contiguous()


@rotary_embedding_op.register_fake
def _(x, cos, sin):
    return x.new_empty(x.shape)


def _schema() -> None:
    """Declare the contrib operators to onnx (once per process), so that the exporter's onnxscript can emit them
    and onnx.checker can check them: the inputs, outputs and attributes edgelin uses."""
    import onnx
    import onnx.reference  # noqa: F401  (before the declarations: see below)
    from onnx.defs import OpSchema

    # onnx's reference evaluator (imported by onnxscript's optimiser) indexes every schema by name when first imported and
    # refuses a name declared in two domains; LinearAttention and RotaryEmbedding are also standard ONNX operators, so it
    # is imported before edgelin declares ONNX Runtime's operators of the same names (any later import reuses that index)

    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    floats = [("T", ["tensor(float)", "tensor(float16)"], "float tensors")]

    def attributes(*pairs) -> list:
        return [OpSchema.Attribute(name, kind, "", required=False) for name, kind in pairs]

    if not onnx.defs.has("LinearAttention", MS_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "LinearAttention", MS_DOMAIN, 1,
            inputs=[param("query", "T"), param("key", "T"), param("value", "T"), param("past_state", "T", param_option=optional),
                    param("decay", "T", param_option=optional), param("beta", "T", param_option=optional)],
            outputs=[param("output", "T"), param("present_state", "T")], type_constraints=floats,
            attributes=attributes(("update_rule", OpSchema.AttrType.STRING), ("q_num_heads", OpSchema.AttrType.INT),
                                  ("kv_num_heads", OpSchema.AttrType.INT), ("scale", OpSchema.AttrType.FLOAT),
                                  ("chunk_size", OpSchema.AttrType.INT)),
        ))
    if not onnx.defs.has("CausalConvWithState", MS_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "CausalConvWithState", MS_DOMAIN, 1,
            inputs=[param("input", "T"), param("weight", "T"), param("bias", "T", param_option=optional),
                    param("past_state", "T", param_option=optional)],
            outputs=[param("output", "T"), param("present_state", "T")], type_constraints=floats,
            attributes=attributes(("channels_last", OpSchema.AttrType.INT), ("activation", OpSchema.AttrType.STRING)),
        ))

    if not onnx.defs.has("SkipSimplifiedLayerNormalization", MS_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "SkipSimplifiedLayerNormalization", MS_DOMAIN, 1,
            inputs=[param("input", "T"), param("skip", "T"), param("gamma", "T"), param("bias", "T", param_option=optional)],
            outputs=[param("output", "T"), param("mean", "U", param_option=optional),
                     param("inv_std_var", "U", param_option=optional), param("input_skip_bias_sum", "T", param_option=optional)],
            type_constraints=[*floats, ("U", ["tensor(float)"], "statistics")],
            attributes=attributes(("epsilon", OpSchema.AttrType.FLOAT)),
        ))
    if not onnx.defs.has("RotaryEmbedding", MS_DOMAIN):
        onnx.defs.register_schema(OpSchema(
            "RotaryEmbedding", MS_DOMAIN, 1,
            inputs=[param("input", "T"), param("position_ids", "M"), param("cos_cache", "T"), param("sin_cache", "T")],
            outputs=[param("output", "T")], type_constraints=[*floats, ("M", ["tensor(int64)"], "positions")],
            attributes=attributes(("interleaved", OpSchema.AttrType.INT), ("num_heads", OpSchema.AttrType.INT),
                                  ("rotary_embedding_dim", OpSchema.AttrType.INT), ("scale", OpSchema.AttrType.FLOAT),
                                  ("is_packed_batching", OpSchema.AttrType.INT)),
        ))
    if not onnx.defs.has("GroupQueryAttention", MS_DOMAIN):
        ints = ("M", ["tensor(int32)"], "lengths")
        onnx.defs.register_schema(OpSchema(
            "GroupQueryAttention", MS_DOMAIN, 1,
            inputs=[param("query", "T"), param("key", "T", param_option=optional), param("value", "T", param_option=optional),
                    param("past_key", "T", param_option=optional), param("past_value", "T", param_option=optional),
                    param("seqlens_k", "M"), param("total_sequence_length", "M"), param("cos_cache", "T", param_option=optional),
                    param("sin_cache", "T", param_option=optional), param("position_ids", "P", param_option=optional),
                    param("attention_bias", "T", param_option=optional)],
            outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
            type_constraints=[*floats, ints, ("P", ["tensor(int64)"], "positions")],
            attributes=attributes(("num_heads", OpSchema.AttrType.INT), ("kv_num_heads", OpSchema.AttrType.INT),
                                  ("scale", OpSchema.AttrType.FLOAT), ("do_rotary", OpSchema.AttrType.INT),
                                  ("rotary_interleaved", OpSchema.AttrType.INT), ("local_window_size", OpSchema.AttrType.INT),
                                  ("softcap", OpSchema.AttrType.FLOAT), ("smooth_softmax", OpSchema.AttrType.INT)),
        ))


def translation_table() -> dict:
    """torch.onnx's ``custom_translation_table``: edgelin's operators -> their ONNX Runtime nodes."""
    import onnx
    import onnxscript
    from onnxscript import opset18 as op

    _schema()
    ms = onnxscript.values.Opset(MS_DOMAIN, 1)

    def linear_attention(q, k, v, past, decay, beta, rule: str, heads: int, scale: float):
        return ms.LinearAttention(q, k, v, past, decay, beta, update_rule=rule, q_num_heads=heads, kv_num_heads=heads,
                                  scale=scale, _outputs=2)

    def causal_conv(x, weight, bias, past, channels_last: bool, silu: bool):
        return ms.CausalConvWithState(x, weight, bias, past, channels_last=int(channels_last),
                                      activation="silu" if silu else "none", _outputs=2)

    def softplus(x):
        return op.Softplus(x)

    def skip_rms_norm(x, skip, weight, eps: float):
        y, _, _, s = ms.SkipSimplifiedLayerNormalization(x, skip, weight, epsilon=eps, _outputs=4)
        return y, s

    def group_query_attention(q, k, v, past_key, past_value, bias, heads: int, kv_heads: int, scale: float):
        total = op.Shape(bias, start=3, end=4)  # [1] int64: P + T
        seqlens = op.Expand(op.Sub(total, op.Constant(value_ints=[1])), op.Shape(bias, start=0, end=1))  # [B]: P + T - 1
        int32 = onnx.TensorProto.INT32
        return ms.GroupQueryAttention(q, k, v, past_key, past_value, op.Cast(seqlens, to=int32),
                                      op.Cast(op.Squeeze(total), to=int32), None, None, None, bias,
                                      num_heads=heads, kv_num_heads=kv_heads, scale=scale, _outputs=3)

    def rotary_embedding(x, cos, sin):
        # the node reads its angles from a table by position id: the table is these B T rows (row b T + t: the angles of
        # row b's position t), each (b, t) looks up its own, so any per-row positions (left-padded rows) keep their meaning
        rows = op.Shape(cos, start=0, end=2)  # [B, T]
        half = op.Shape(cos, start=2, end=3)  # [r / 2]
        n = op.ReduceProd(rows, keepdims=1)  # [1]: B T
        table = op.Concat(n, half, axis=0)  # [B T, r / 2]
        ids = op.Reshape(op.Range(op.Constant(value_int=0), op.Squeeze(n), op.Constant(value_int=1)), rows)  # [B, T]: 0 .. B T - 1
        heads, rotary = x.shape[1], 2 * cos.shape[2]
        return ms.RotaryEmbedding(x, ids, op.Reshape(cos, table), op.Reshape(sin, table), interleaved=0, num_heads=heads,
                                  rotary_embedding_dim=rotary)

    return {torch.ops.edgelin.linear_attention.default: linear_attention,
            torch.ops.edgelin.rotary_embedding.default: rotary_embedding,
            torch.ops.edgelin.causal_conv.default: causal_conv,
            torch.ops.edgelin.softplus.default: softplus,
            torch.ops.edgelin.skip_rms_norm.default: skip_rms_norm,
            torch.ops.edgelin.group_query_attention.default: group_query_attention}


# ---- the forms' fused path ---------------------------------------------------------------------------
def _packed(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B, T, H D] (T = 1: a Reshape, no Transpose)."""
    B, H, T, D = x.shape
    return x.reshape(B, T, H * D) if T == 1 else x.transpose(1, 2).reshape(B, T, H * D)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, H D] -> [B, H, T, D]."""
    B, T, _ = x.shape
    return x.reshape(B, heads, 1, -1) if T == 1 else x.view(B, T, heads, -1).transpose(1, 2)


def _decay(g: torch.Tensor | None) -> torch.Tensor | None:
    """edgelin's log-decay [B, H, T] (per head) or [B, H, T, F] (per feature) -> the node's [B, T, H (F)]."""
    if g is None:
        return None
    return g.transpose(1, 2) if g.dim() == 3 else _packed(g)


def additive(fq, fk, v, S, z, g, eps: float, signed: bool):
    """Linear attention (decayed or not) through the node: phi(q), phi(k) [B, H, T, F], v [B, H, T, Dv], S [B, H, F,
    Dv], z [B, H, F] or None (no denominator), g as the forms take it. -> (o [B, H, T, Dv], S, z)."""
    H, Dv = fq.shape[1], v.shape[-1]
    if z is not None:  # the denominator as one more value column of ones: S' = [S | z]
        v, S = F.pad(v, (0, 1), value=1.0), torch.cat([S, z[..., None]], dim=-1)
    rule = "linear" if g is None else "gated"
    o, S = linear_attention_op(_packed(fq), _packed(fk), _packed(v), S, _decay(g), None, rule, H, 1.0)
    o = _heads(o, H)  # [B, H, T, Dv (+ 1)]
    if z is None:
        return o, S, None
    o = o[..., :Dv] / padded_denominator(o[..., Dv:], eps, signed)
    return o, S[..., :Dv], S[..., Dv]


def fused_additive(state: State, fq, fk, v, g, eps: float, normalize: bool, signed: bool) -> tuple[torch.Tensor, State]:
    """The additive forms' state update as one fused node: (o [B, H, T, Dv], the next state)."""
    o, S, z = additive(fq, fk, v, state["S"], state["z"] if normalize else None, g, eps, signed)
    return o, advance(state, fq.shape[2], S=S, **({"z": z} if normalize else {}))


def delta(q, k, v, beta, g, S):
    """The delta rule through the node: q (scaled, normalised), k (normalised) [B, H, T, K], v [B, H, T, V], beta
    [B, H, T], g [B, H, T] or None, S [B, H, K, V] -> (o [B, H, T, V], S)."""
    H = q.shape[1]
    rule = "delta" if g is None else "gated_delta"
    o, S = linear_attention_op(_packed(q), _packed(k), _packed(v), S, _decay(g), beta.transpose(1, 2), rule, H, 1.0)
    return _heads(o, H), S


def softplus(x: torch.Tensor) -> torch.Tensor:
    """softplus(x): one Softplus node under the fused lowering (torch's threshold otherwise exports as Softplus,
    Greater and Where: three nodes for what ONNX Runtime's Softplus computes without overflow on its own)."""
    return softplus_op(x) if active() else F.softplus(x)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, past: torch.Tensor, *, channels_last: bool,
                silu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A short causal depthwise convolution with its carried window through one CausalConvWithState node
    (``_conv_reference`` says what it computes); the caller checks ``active()`` and keeps ragged batches portable."""
    return causal_conv_op(x, weight, bias, past, channels_last, silu)


def skip_rms_norm(x: torch.Tensor, skip: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x + skip and the RMSNorm of it, (norm [.., d], sum [.., d]), through one SkipSimplifiedLayerNormalization node;
    the caller checks ``active()``."""
    return skip_rms_norm_op(x, skip, weight, eps)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, D] rotated by halves at the angles cos, sin [B, T, r / 2] through one com.microsoft.RotaryEmbedding node
    (the first r features of each head; the rest pass); the caller checks ``active()``."""
    return rotary_embedding_op(x, cos, sin)


def attention_bias(seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """edgelin's mask rule seen [B, 1, T, P + T] bool as GroupQueryAttention's additive bias: 0 where seen, -inf elsewhere."""
    return torch.where(seen, 0.0, float("-inf")).to(dtype)


def group_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor, bias: torch.Tensor,
    heads: int, kv_heads: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention over the cache through one GroupQueryAttention node: q [B, T, H D], k, v [B, T, H_kv D] (RoPE
    and norms applied), past_key / past_value [B, H_kv, P, D], bias [B, 1, T, P + T] (``attention_bias`` of edgelin's
    mask rule) -> (o [B, T, H D], keys, values [B, H_kv, P + T, D]). The caller checks ``active()`` and a batch-wide T
    of 1. The node's lengths are read from the bias's shape, so the layers of one step that share a bias share them too."""
    return group_query_attention_op(q, k, v, past_key, past_value, bias, heads, kv_heads, scale)


__all__ = ["DEFAULT_LOWERING", "LOWERINGS", "active", "additive", "attention_bias", "causal_conv", "causal_conv_op", "delta", "fused_additive",
           "group_query_attention", "group_query_attention_op", "linear_attention_op", "lowering", "rotary_embedding",
           "rotary_embedding_op", "rotate_halves", "skip_rms_norm", "skip_rms_norm_op", "softplus", "softplus_op", "translation_table"]
