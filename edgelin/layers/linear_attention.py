"""Linear attention layers: edgelin's own (kind "linear": a feature map, an optional decay, the additive or the delta
rule, an optional short conv) and flash-linear-attention's LinearAttention (kind "fla/linear_attn": fla's feature
maps and conventions). The math of every form is in edgelin.ops.

edgelin's layer: q, k, v projections split into heads; phi from the feature map registry; a decay (``cfg.decay``)
gives each layer a log-decay g <= 0 from its input (a constant or a function of the current token only, so it adds
no state), S_t = exp(g_t) S_{t-1} + phi(k_t) v_t^T; the delta rule (``cfg.update = "delta"``) replaces what the state
holds for a key instead of adding to it. fla's layer, with fla's conventions carried over exactly (docs/importers.md):
- q goes through the feature map, then (``norm_q``) phi(q) / (sum phi(q) + 1e-4), then times F^-0.5, where F is
  the feature width (2 D for hedgehog, 8 D for dpfp); keys likewise without the scale (``norm_k``).
- With ``norm_feature_map`` the output is divided by the running denominator with fla's epsilon 1e-10 added
  to the *scaled* denominator; without it there is no denominator. A per-head RMSNorm (weight only with
  ``elementwise_affine``) always follows.
- ``num_kv_heads``: query head h reads key/value head h // (num_heads / num_kv_heads). Every query head of a
  group would build the same state, so the state is carried once per key/value head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.config import ModelConfig
from edgelin.layers import check_form, register_mixer
from edgelin.layers.feature_maps import Adjusted, FeatureMap, make_feature_map
from edgelin.layers.heads import share_state, split_heads, unshare_state
from edgelin.layers.norms import RMSNorm, fixed_norm
from edgelin.ops import DELTA_FORMS, FORMS, State, recurrent_step, state_layout
from edgelin.ops import fused

class ShortConv(nn.Module):
    """Causal depthwise convolution over the last ``size`` tokens: y_t = sum_i w_i * x_{t - size + 1 + i}.

    Its window (the previous size - 1 inputs) is carried in the state, so prefill and decode agree.
    Starts as the identity (last tap 1, others 0).
    """

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.size = size
        weight = torch.zeros(dim, 1, size)
        weight[:, 0, -1] = 1.0
        self.weight = nn.Parameter(weight)  # [d, 1, size]

    def forward(
        self, x: torch.Tensor, past: torch.Tensor, step: bool = False, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step`` (one token, the decode graph): a weighted sum over the window (Mul + ReduceSum) instead of
        Conv and its two Transposes, which cost ONNX Runtime ~55 us per layer and token on this project's CPU
        (the bundled model decoded 20-32 % faster without them, two interleaved runs)."""
        if fused.active() and lengths is None and self.size > 1:  # the fused lowering: one CausalConvWithState node
            return fused.causal_conv(x, self.weight, None, past, channels_last=True)  # [B, T, d], [B, size - 1, d]
        full = torch.cat([past, x], dim=1)  # [B, size - 1 + T, d]
        if step:
            y = (full * self.weight[:, 0, :].t()).sum(1, keepdim=True)  # [B, size, d] x [size, d] -> [B, 1, d]
        else:
            y = F.conv1d(full.transpose(1, 2), self.weight, groups=self.weight.shape[0]).transpose(1, 2)  # [B, T, d]
        if lengths is not None:  # a ragged batch: each row's window ends at its last real input
            return y, self.window(full, lengths)  # [B, T, d], [B, size - 1, d]
        return y, full[:, 1 - self.size :]  # [B, T, d], new window [B, size - 1, d]

    def window(self, full: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The size - 1 inputs before position lengths[b] of each row of ``full`` = [window, x]: rows
        [lengths[b], lengths[b] + size - 1) of ``full`` [B, size - 1 + T, d] (length 0 keeps the old window)."""
        at = lengths[:, None] + torch.arange(self.size - 1, device=full.device)[None, :]  # [B, size - 1]
        return torch.gather(full, 1, at[:, :, None].expand(-1, -1, full.shape[2]))  # [B, size - 1, d]


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y, for y > 0: log(exp(y) - 1), computed as y + log(-expm1(-y))."""
    return y + torch.log(-torch.expm1(-y))


class FixedDecay(nn.Module):
    """RetNet's retention decay (Sun et al. 2023, "Retentive Network", section 2.2): a fixed gamma per head,
    gamma_h = 1 - 2^(-5-h) for h = 0..H-1 (0.969, 0.984, 0.992, ... : memories of ~32, 64, 128, ... tokens).
    No parameters and no buffer: gamma is computed from the config in the model's dtype, so it is exact
    in float64 too (a constant in the exported graphs)."""

    def __init__(self, cfg: ModelConfig, feature_dim: int) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = torch.arange(self.n_heads, dtype=x.dtype, device=x.device)  # [H]
        log_gamma = torch.log1p(-torch.pow(2.0, -5.0 - h))  # [H], log(1 - 2^(-5-h)) without cancellation
        return log_gamma[None, :, None].expand(B, -1, T)  # [B, H, T]


class ScalarDecay(nn.Module):
    """A data-dependent decay per head and token, Mamba2's form (Dao & Gu 2024, "Transformers are SSMs",
    the SSD layer; the same gate as fla's simple GLA): g_t = -exp(A_log) * softplus(x_t W_dt + dt_bias).

    Init: A_log = 0 (A = 1) and dt_bias = softplus^-1(dt_h) with dt_h spaced geometrically over
    [1e-3, 1e-1] across heads (Mamba's dt range), so the decay starts near 1, at exp(-dt_h) in
    [0.905, 0.999] for x W_dt = 0: a spread of memory lengths with head 0 the shortest, as in RetNet.
    W_dt gets the model's N(0, 0.02), which moves dt by a factor of about exp(+-0.2) at d_model 128
    (gates ~0.85 at the least)."""

    DT_RANGE = (1e-3, 1e-1)

    def __init__(self, cfg: ModelConfig, feature_dim: int) -> None:
        super().__init__()
        self.dt_proj = nn.Linear(cfg.d_model, cfg.n_heads, bias=False)
        lo, hi = (math.log(v) for v in self.DT_RANGE)
        dt = torch.exp(torch.linspace(hi, lo, cfg.n_heads, dtype=torch.float64))  # [H], largest (fastest decay) first
        self.dt_bias = nn.Parameter(inverse_softplus(dt).to(torch.get_default_dtype()))  # [H]
        self.A_log = nn.Parameter(torch.zeros(cfg.n_heads))  # [H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = fused.softplus(self.dt_proj(x) + self.dt_bias)  # [B, T, H]
        return (-self.A_log.exp() * dt).transpose(1, 2)  # [B, H, T]


class GLADecay(nn.Module):
    """A data-dependent decay per feature, GLA's gate (Yang et al. 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training", eq. 4; fla's GatedLinearAttention): a low-rank projection
    d_model -> gate_rank -> H * F, then g = logsigmoid(.) / 16 (fla's gate_logit_normalizer; it keeps
    the gate near 1). F is the feature map's output width: the gate scales the rows of S and z.

    Init: the model's N(0, 0.02) on both matrices and a zero bias, so the decay starts near
    sigmoid(0)^(1/16) = 0.958 for every feature.

    Cost: the chunked (prefill) form holds a [T, C, F] decay tensor per head for a per-feature gate
    (edgelin.ops.chunk), C times F more than a per-head gate; prefer chunk_size 16-32 for long prompts."""

    NORMALIZER = 16.0

    def __init__(self, cfg: ModelConfig, feature_dim: int) -> None:
        super().__init__()
        self.n_heads, self.feature_dim = cfg.n_heads, feature_dim
        self.gate_down = nn.Linear(cfg.d_model, cfg.gate_rank, bias=False)
        self.gate_up = nn.Linear(cfg.gate_rank, cfg.n_heads * feature_dim, bias=True)
        nn.init.zeros_(self.gate_up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        g = F.logsigmoid(self.gate_up(self.gate_down(x))) / self.NORMALIZER  # [B, T, H * F]
        return g.view(B, T, self.n_heads, self.feature_dim).transpose(1, 2)  # [B, H, T, F]


# cfg.decay -> the module computing a layer's log-decay g from its input x [B, T, d_model], or None
DECAYS = {"none": None, "fixed": FixedDecay, "scalar": ScalarDecay, "gla": GLADecay}


@register_mixer("linear")
class LinearAttention(nn.Module):
    """LinearLM's mixer kind "linear" (edgelin.skeleton): linear attention with its feature map, decay, update rule
    and short conv, in every form of edgelin.ops."""

    accepts_lengths = True  # ragged batches in the sequence forms (edgelin.ops.lengths)

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.forms = tuple(DELTA_FORMS if cfg.update == "delta" else FORMS)
        self.variant = f", update {cfg.update!r}" if cfg.update != "additive" else ""  # named in errors
        self.bounded_state = cfg.decay != "none"  # S and z forget; the conv window and position are bounded
        inner = cfg.n_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.phi = make_feature_map(
            cfg.feature_map, cfg.head_dim, n_features=cfg.n_features,
            seed=cfg.feature_seed + layer, horizon=cfg.cosformer_horizon,
        )
        self.normalize = cfg.normalisation == "denominator"
        # without the denominator, a per-head RMSNorm keeps the output scale in check
        self.out_norm = None if self.normalize else RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.conv = ShortConv(cfg.d_model, cfg.conv_size) if cfg.conv_size else None
        decay = DECAYS[cfg.decay]
        self.decay = None if decay is None else decay(cfg, self.phi.out_dim)
        # the delta rule's write strength beta per head and token (cfg.update "delta"; edgelin.ops.delta)
        self.beta_proj = nn.Linear(cfg.d_model, cfg.n_heads, bias=False) if cfg.update == "delta" else None

    def state_layout(self) -> dict[str, tuple]:
        """name -> (shape with "batch", dtype name, init) of this layer's state: S, z, pos, conv."""
        layout = state_layout(self.phi, n_heads=self.cfg.n_heads, value_dim=self.cfg.head_dim, normalize=self.normalize)
        if self.conv is not None:
            layout["conv"] = (("batch", self.conv.size - 1, self.cfg.d_model), "float32", 0.0)
        return layout

    def _mix(
        self, x: torch.Tensor, state: State | None, step: bool = False, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State | None, State]:
        """The short conv, if any: (mixed x, the attention's part of the state, the conv's new window)."""
        if self.conv is None:
            return x, state, {}
        if state is None:
            past = x.new_zeros(x.shape[0], self.conv.size - 1, x.shape[2])  # [B, size - 1, d]
        else:
            state = dict(state)
            past = state.pop("conv")
        x, window = self.conv(x, past, step, lengths)
        return x, state, {"conv": window}

    def _heads(self, x: torch.Tensor, step: bool = False) -> torch.Tensor:
        B, T, _ = x.shape
        if step:  # T = 1: the same memory as the transposed view below, with no Transpose node in a graph
            return x.view(B, self.cfg.n_heads, 1, self.cfg.head_dim)  # [B, H, 1, Dh]
        return x.view(B, T, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 2)  # [B, H, T, Dh]

    def _merge(self, o: torch.Tensor, step: bool = False) -> torch.Tensor:
        if self.out_norm is not None:
            o = self.out_norm(o)
        B, H, T, D = o.shape
        if step:  # as in _heads: one token needs no Transpose
            return self.o_proj(o.reshape(B, 1, H * D))  # [B, 1, d_model]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))  # [B, T, d_model]

    def _qkv(self, x, step: bool = False):
        return self._heads(self.q_proj(x), step), self._heads(self.k_proj(x), step), self._heads(self.v_proj(x), step)

    def forward(
        self, x: torch.Tensor, state: State | None, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        """x [B, T, d_model] -> [B, T, d_model] and the layer's next state; ``form`` names the attention
        form (edgelin.ops.FORMS): "chunk" for the prefill graph, "step" (T = 1) for the decode graph.
        The decay's gate reads the layer input before the short conv, as the gates of Mamba2 and GLA do.
        ``lengths`` [B] (sequence forms only): a right-padded ragged batch, see edgelin.ops.lengths."""
        g = None if self.decay is None else self.decay(x)  # [B, H, T] or [B, H, T, F]
        x_in = x
        step = form == "step"
        x, state, conv = self._mix(x, state, step=step, lengths=lengths)
        ragged = {} if lengths is None else {"lengths": lengths}  # the step form takes no lengths
        q, k, v = self._qkv(x, step)  # [B, H, T, Dh] each
        if self.beta_proj is not None:
            return self._delta(x_in, q, k, v, g, state, form, ragged, step, conv, chunk_size or self.cfg.chunk_size)
        o, state = FORMS[form](
            q, k, v, feature_map=self.phi, initial_state=state,
            chunk_size=chunk_size or self.cfg.chunk_size, eps=self.cfg.eps, normalize=self.normalize, g=g, **ragged,
        )
        return self._merge(o, step), {**state, **conv}

    def _delta(self, x, q, k, v, g, state, form, ragged, step, conv, chunk_size):
        """The delta rule's forms (edgelin.ops.DELTA_FORMS) on phi(q), phi(k), L2-normalised there. beta reads
        the layer input before the short conv, as the decay's gate does."""
        if form not in DELTA_FORMS:
            raise ValueError(f"update 'delta' runs in the forms {', '.join(DELTA_FORMS)}, not {form!r}")
        B, T, _ = x.shape
        b = torch.sigmoid(self.beta_proj(x))  # [B, T, H]
        beta = b.view(B, self.cfg.n_heads, 1) if step else b.transpose(1, 2)  # [B, H, T]
        fq, fk = self.phi(q, is_query=True), self.phi(k, is_query=False)  # [B, H, T, F]
        o, state = DELTA_FORMS[form](
            fq, fk, v, beta, g=g, initial_state=state, chunk_size=chunk_size,
            scale=fq.shape[-1] ** -0.5, qk_l2norm=True, **ragged,
        )
        return self._merge(o, step), {**state, **conv}


# ---- flash-linear-attention's LinearAttention ----------------------------------------------------------------------

FLA_DENOMINATOR_EPS = 1e-10  # added to the scaled denominator
# The ONNX exporter's graph optimizer drops an added constant below 1e-8 as if it were zero (measured with
# torch 2.13 + onnxscript 0.7.2), which would turn 0 / 0 into NaN where the denominator is exactly zero (dpfp's
# sparse features make that happen). With the denominator, q is scaled by a further 2^14: numerator and
# denominator grow alike (exactly, a power of two), and the epsilon becomes 2^14 * 1e-10 = 1.6e-6.
DENOMINATOR_GAIN = 2.0**14
FLA_SUM_NORM_EPS = 1e-4  # norm_q / norm_k: phi / (sum phi + 1e-4)


@dataclass(frozen=True)
class LinearAttnOptions:
    num_heads: int
    num_kv_heads: int
    head_k_dim: int
    head_v_dim: int
    feature_map: str  # edgelin's registry name
    tie_qk: bool
    norm_q: bool
    norm_k: bool
    normalize: bool  # norm_feature_map: divide by the running denominator
    elementwise_affine: bool


@register_mixer("fla/linear_attn")
class FlaLinearAttention(nn.Module):
    """fla's LinearAttention layer on edgelin's forms; the state is carried per key/value head."""

    forms = ("chunk", "step")
    accepts_lengths = False
    bounded_state = False  # a plain running sum

    def __init__(self, o: LinearAttnOptions, common: Any) -> None:  # common: hidden_size, norm_eps (edgelin.layers.LayerSizes, fla's Common)
        super().__init__()
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        hidden = common.hidden_size
        self.q_proj = nn.Linear(hidden, o.num_heads * o.head_k_dim, bias=False)
        self.k_proj = nn.Linear(hidden, o.num_kv_heads * o.head_k_dim, bias=False)
        self.v_proj = nn.Linear(hidden, o.num_kv_heads * o.head_v_dim, bias=False)
        self.o_proj = nn.Linear(o.num_heads * o.head_v_dim, hidden, bias=False)
        inner: FeatureMap = make_feature_map(o.feature_map, o.head_k_dim, tie_qk=o.tie_qk)
        gain = DENOMINATOR_GAIN if o.normalize else 1.0
        self.eps = FLA_DENOMINATOR_EPS * gain
        self.phi = Adjusted(
            inner, query_scale=inner.out_dim**-0.5 * gain, sum_norm_query=o.norm_q, sum_norm_key=o.norm_k,
            sum_eps=FLA_SUM_NORM_EPS,
        )
        self.norm = RMSNorm(o.head_v_dim, common.norm_eps)
        if not o.elementwise_affine:  # fla's output norm then has no weight: a fixed 1, not in the checkpoint
            fixed_norm(self.norm)

    def state_layout(self) -> dict[str, tuple]:
        return state_layout(self.phi, n_heads=self.o.num_kv_heads, value_dim=self.o.head_v_dim, normalize=self.o.normalize)

    def _heads(self, x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return split_heads(x, heads, dim, self.groups if heads != self.o.num_heads else 1)  # [B, H, T, dim]

    def _share(self, state: State) -> State:
        return share_state(state, self.groups)

    def _unshare(self, state: State) -> State:
        return unshare_state(state, self.groups)

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """"chunk" (the prefill graph, fla's chunked form) or "step" (one token, the decode graph)."""
        check_form(self, form, lengths)
        o = self.o
        q = self._heads(self.q_proj(x), o.num_heads, o.head_k_dim)  # [B, H, T, Dk]
        k = self._heads(self.k_proj(x), o.num_kv_heads, o.head_k_dim)  # [B, H, T, Dk]
        v = self._heads(self.v_proj(x), o.num_kv_heads, o.head_v_dim)  # [B, H, T, Dv]
        common = dict(feature_map=self.phi, initial_state=self._share(state), eps=self.eps, normalize=o.normalize)
        if form == "step":
            y, state = recurrent_step(q, k, v, **common)  # [B, H, 1, Dv]
        else:
            y, state = FORMS["chunk"](q, k, v, chunk_size=chunk_size, **common)  # [B, H, T, Dv]
        y = self.norm(y)
        B, H, T, D = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D)), self._unshare(state)  # [B, T, hidden]
