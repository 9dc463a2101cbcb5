"""The fused lowering: linear attention's recurrence as ONNX Runtime's ``com.microsoft.LinearAttention`` node.

``edgelin export --ops fused`` (``export(..., ops="fused")``) traces the graphs with ``lowering("fused")``
active. Inside it, the state update of every linear-attention form the graphs use -- ``recurrent_step`` and
``delta_step`` (the decode graph), ``chunk_linear_attention`` and ``chunk_delta_rule`` (the prefill graph) --
calls the torch operator ``edgelin::linear_attention`` instead of its portable code, and the exporter
translates that operator into one ``com.microsoft.LinearAttention`` node (ONNX Runtime >= 1.30 on CPU, onnxruntime-node and
onnxruntime-web's WASM backend). Two smaller pieces go the same way: each short causal convolution with a carried
window (``causal_conv``: ``edgelin::causal_conv`` -> one ``com.microsoft.CausalConvWithState`` node) and softplus
(``softplus``: ``edgelin::softplus`` -> one ``Softplus`` node, not torch's Softplus + Greater + Where). Everything
else around them (projections, feature maps, gates, norms) is unchanged.

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


def _schema() -> None:
    """Declare the contrib operators to onnx (once per process), so that the exporter's onnxscript can emit them
    and onnx.checker can check them: the inputs, outputs and attributes edgelin uses."""
    import onnx
    from onnx.defs import OpSchema

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


def translation_table() -> dict:
    """torch.onnx's ``custom_translation_table``: edgelin's operators -> their ONNX Runtime nodes."""
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

    return {torch.ops.edgelin.linear_attention.default: linear_attention,
            torch.ops.edgelin.causal_conv.default: causal_conv,
            torch.ops.edgelin.softplus.default: softplus}


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


__all__ = ["DEFAULT_LOWERING", "LOWERINGS", "active", "additive", "causal_conv", "causal_conv_op", "delta", "fused_additive", "linear_attention_op", "lowering", "softplus",
           "softplus_op", "translation_table"]
