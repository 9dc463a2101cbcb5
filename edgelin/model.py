"""LinearLM: a decoder-only language model whose attention is linear (kernelised).

    tokens -> embedding -> n_layers x [RMSNorm -> linear attention -> + -> RMSNorm -> SwiGLU -> +] -> RMSNorm -> LM head

Two ways to run it, with the same weights and the same state:
- ``forward(input_ids, state)``: the whole sequence at once (chunked parallel form): the prefill graph;
- ``step(input_ids[B, 1], state)``: one token with a fixed-size state (the "step" form): the decode graph.
The two differ only in the attention form; ``LinearLM`` implements the model protocol (edgelin.protocol).

The state is a flat ordered dict "{layer}.{name}" -> tensor (names: S, z, pos, conv) whose contract
``state_specs()`` declares; the exporter turns each key into graph input ``state.{key}`` and output
``present.{key}``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.config import ModelConfig
from edgelin.feature_maps import make_feature_map
from edgelin.ops import FORMS, State, state_layout
from edgelin.runtime.manifest import StateSpec
from edgelin.state import fresh_state


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


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

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = torch.cat([past, x], dim=1)  # [B, size - 1 + T, d]
        y = F.conv1d(full.transpose(1, 2), self.weight, groups=self.weight.shape[0])  # [B, d, T]
        return y.transpose(1, 2), full[:, 1 - self.size :]  # [B, T, d], new window [B, size - 1, d]


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

    def state_layout(self) -> dict[str, tuple]:
        """name -> (shape with "batch", dtype name, init) of this layer's state: S, z, pos, conv."""
        layout = state_layout(self.phi, n_heads=self.cfg.n_heads, value_dim=self.cfg.head_dim, normalize=self.normalize)
        if self.conv is not None:
            layout["conv"] = (("batch", self.conv.size - 1, self.cfg.d_model), "float32", 0.0)
        return layout

    def _mix(self, x: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State | None, State]:
        """The short conv, if any: (mixed x, the attention's part of the state, the conv's new window)."""
        if self.conv is None:
            return x, state, {}
        if state is None:
            past = x.new_zeros(x.shape[0], self.conv.size - 1, x.shape[2])  # [B, size - 1, d]
        else:
            state = dict(state)
            past = state.pop("conv")
        x, window = self.conv(x, past)
        return x, state, {"conv": window}

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 2)  # [B, H, T, Dh]

    def _merge(self, o: torch.Tensor) -> torch.Tensor:
        if self.out_norm is not None:
            o = self.out_norm(o)
        B, H, T, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))  # [B, T, d_model]

    def _qkv(self, x):
        return self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def forward(self, x: torch.Tensor, state: State | None, form: str = "chunk") -> tuple[torch.Tensor, State]:
        """x [B, T, d_model] -> [B, T, d_model] and the layer's next state; ``form`` names the attention
        form (edgelin.ops.FORMS): "chunk" for the prefill graph, "step" (T = 1) for the decode graph."""
        x, state, conv = self._mix(x, state)
        q, k, v = self._qkv(x)  # [B, H, T, Dh] each
        o, state = FORMS[form](
            q, k, v, feature_map=self.phi, initial_state=state,
            chunk_size=self.cfg.chunk_size, eps=self.cfg.eps, normalize=self.normalize,
        )
        return self._merge(o), {**state, **conv}


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

    def forward(self, x, state, form="chunk"):
        h, state = self.attn(self.attn_norm(x), state, form)
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

    def forward(self, input_ids: torch.Tensor, state: State | None = None, *, form: str = "chunk") -> tuple[torch.Tensor, State]:
        """input_ids [B, T] -> logits [B, T, vocab], state after the last token. ``form``: the attention
        form of every layer (edgelin.ops.FORMS); "step" takes T = 1 and is what ``step`` runs."""
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x = self.embed(input_ids)  # [B, T, d_model]
        new_state: State = {}
        for i, block in enumerate(self.blocks):
            x, layer = block(x, self._layer_state(state, i), form)
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


__all__ = ["LinearLM", "RMSNorm"]
