"""LinearLM: a decoder-only language model whose attention is linear (kernelised).

    tokens -> embedding -> n_layers x [RMSNorm -> linear attention -> + -> RMSNorm -> SwiGLU -> +] -> RMSNorm -> LM head

Two ways to run it, with the same weights and the same state:
- ``forward(input_ids, state)``: the whole sequence at once (chunked parallel form): the prefill graph;
- ``step(input_ids[B, 1], state)``: one token with a fixed-size state (the "step" form): the decode graph.
The two differ only in the attention form; ``LinearLM`` implements the model protocol (edgelin.protocol).

The state is a flat ordered dict "{layer}.{name}" -> tensor (names: S, z, pos, conv) whose contract
``state_specs()`` declares; the exporter turns each key into graph input ``state.{key}`` and output
``present.{key}``.

A decay (``cfg.decay``, registry ``DECAYS``) makes the state forget: each layer computes a log-decay g
<= 0 from its input and hands it to the attention form (edgelin.ops), S_t = exp(g_t) S_{t-1} + phi(k_t)
v_t^T. g is a constant or a function of the current token only, so a decay adds no state. With decay
"none" the model has exactly the modules, weights, state and graphs it has without the field.

The delta rule (``cfg.update = "delta"``, edgelin.ops.delta) replaces what the state holds for a key instead of
adding to it: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, with k = l2norm(phi(k)), q likewise
(scaled by F^-1/2), beta = sigmoid(W_beta x) per head and token, and alpha = exp(g) from the layer's decay (none:
DeltaNet; "scalar": Gated DeltaNet's gate). With "additive" (the default) nothing of this exists.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.config import ModelConfig
from edgelin.feature_maps import make_feature_map
from edgelin.ops import DELTA_FORMS, FORMS, State, state_layout
from edgelin.ops.lengths import check_lengths
from edgelin.runtime.manifest import StateSpec
from edgelin.state import fresh_state


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x / sqrt, not x * rsqrt: ONNX Runtime fuses exactly this pattern (Pow, ReduceMean, Add, Sqrt, Div, Mul)
        # into one SimplifiedLayerNormalization node when it loads a graph; the rsqrt form stays 8 nodes
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


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
        dt = F.softplus(self.dt_proj(x) + self.dt_bias)  # [B, T, H]
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


class LinearAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
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
        self, x: torch.Tensor, state: State | None, form: str = "chunk", lengths: torch.Tensor | None = None
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
            return self._delta(x_in, q, k, v, g, state, form, ragged, step, conv)
        o, state = FORMS[form](
            q, k, v, feature_map=self.phi, initial_state=state,
            chunk_size=self.cfg.chunk_size, eps=self.cfg.eps, normalize=self.normalize, g=g, **ragged,
        )
        return self._merge(o, step), {**state, **conv}

    def _delta(self, x, q, k, v, g, state, form, ragged, step, conv):
        """The delta rule's forms (edgelin.ops.DELTA_FORMS) on phi(q), phi(k), L2-normalised there. beta reads
        the layer input before the short conv, as the decay's gate does."""
        if form not in DELTA_FORMS:
            raise ValueError(f"update 'delta' runs in the forms {', '.join(DELTA_FORMS)}, not {form!r}")
        B, T, _ = x.shape
        b = torch.sigmoid(self.beta_proj(x))  # [B, T, H]
        beta = b.view(B, self.cfg.n_heads, 1) if step else b.transpose(1, 2)  # [B, H, T]
        fq, fk = self.phi(q, is_query=True), self.phi(k, is_query=False)  # [B, H, T, F]
        o, state = DELTA_FORMS[form](
            fq, fk, v, beta, g=g, initial_state=state, chunk_size=self.cfg.chunk_size,
            scale=fq.shape[-1] ** -0.5, qk_l2norm=True, **ragged,
        )
        return self._merge(o, step), {**state, **conv}


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LinearAttention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, state, form="chunk", lengths=None):
        h, state = self.attn(self.attn_norm(x), state, form, lengths)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), state


def init_weights(model: nn.Module) -> None:
    """GPT-2 style: N(0, 0.02) for every linear and embedding weight, then the residual projections
    (attn.o_proj, mlp.down) of each block scaled by 1/sqrt(2 n_layers). Shared by LinearLM and SoftmaxLM."""

    def normal(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    model.apply(normal)
    for block in model.blocks:
        for proj in (block.attn.o_proj, block.mlp.down):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * len(model.blocks)))


class LinearLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self)

    # ---- the model protocol (edgelin.protocol) ----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def chunk_size(self) -> int:
        return self.cfg.chunk_size

    accepts_lengths = True  # forward(..., lengths=) prefills a right-padded ragged batch (edgelin.protocol)

    @property
    def state_decays(self) -> bool:
        """S and z forget at a decay < 1 (cfg.decay); the other states (conv window, position) are bounded."""
        return self.cfg.decay != "none"

    def model_config(self) -> dict:
        """The config, recorded as the manifest's "model" field."""
        return self.cfg.to_dict()

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The state contract, in graph order: per layer S, z (with the denominator), pos (cosFormer), conv."""
        return tuple(
            StateSpec.for_key(f"{i}.{name}", shape, dtype, init)
            for i, block in enumerate(self.blocks)
            for name, (shape, dtype, init) in block.attn.state_layout().items()
        )

    def init_state(self, batch: int) -> State:
        """Every state tensor at its init value; float tensors in the model's dtype."""
        p = self.embed.weight
        return fresh_state(self.state_specs(), batch, dtype=p.dtype, device=p.device)

    @staticmethod
    def _layer_state(state: State, i: int) -> State:
        prefix = f"{i}."
        return {name[len(prefix):]: t for name, t in state.items() if name.startswith(prefix)}

    # ---- running -------------------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        if self.lm_head is None:
            return x @ self.embed.weight.T  # [B, T, vocab]
        return self.lm_head(x)  # [B, T, vocab]

    def forward(
        self, input_ids: torch.Tensor, state: State | None = None, *, form: str = "chunk", lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """input_ids [B, T] -> logits [B, T, vocab], state after the last token. ``form``: the attention
        form of every layer (edgelin.ops.FORMS); "step" takes T = 1 and is what ``step`` runs.

        ``lengths`` [B] int64 (a ragged batch, right padding; sequence forms only): row b's real tokens are
        its first lengths[b]; its returned state is that after its last real token, exactly as prefilling
        the row alone, and its logits at t >= lengths[b] mean nothing (edgelin.ops.lengths)."""
        if lengths is not None:
            if form in ("step", "recurrent"):
                raise ValueError(f"the {form} form takes no lengths (ragged batches run in the naive, chunk and parallel forms)")
            lengths = check_lengths(lengths, tuple(input_ids.shape))
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.embed(input_ids)  # [B, T, d_model]
        new_state: State = {}
        for i, block in enumerate(self.blocks):
            x, layer = block(x, self._layer_state(state, i), form, lengths)
            new_state.update({f"{i}.{name}": t for name, t in layer.items()})
        return self._logits(x), new_state

    def step(self, input_ids: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """One token per sequence: input_ids [B, 1] -> logits [B, 1, vocab], the next state."""
        return self.forward(input_ids, state, form="step")

    def with_chunk_size(self, chunk_size: int) -> "LinearLM":
        """The same weights with another prefill chunk length (the chunk changes no result, only speed)."""
        if chunk_size == self.cfg.chunk_size:
            return self
        model = LinearLM(self.cfg.replace(chunk_size=chunk_size)).to(self.embed.weight.dtype)
        model.load_state_dict(self.state_dict())
        return model.train(self.training)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


__all__ = ["DECAYS", "FixedDecay", "GLADecay", "LinearLM", "RMSNorm", "ScalarDecay"]
