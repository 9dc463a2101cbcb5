"""Zamba2's hybrid layer as the skeleton's mixer kind "zamba2/hybrid": a transformer block whose weights several layers
share, fed the hidden state beside the model's input embeddings, then a Mamba2 layer.

Per hybrid layer, as transformers' ``Zamba2HybridLayer`` computes it (x [B, T, d], e the input embeddings [B, T, d]):

    h = input_layernorm([x, e])                                       (an RMSNorm over 2 d)
    a = attention(h)      q, k, v = W h + B_j A_j h (the use's adapters), 2 d / H wide heads, scale (D / 2)^-0.5,
                          RoPE by halves over the whole head (optional), o_proj 2 d -> d
    m = down(act(g) * u), [g, u] = gate_up(a') + B_j A_j a'           a' = pre_ff_layernorm(a)
    y = mamba(norm(x + linear(m)))                                    (edgelin.layers.mamba2's mixer)

and the block adds y to x (``Block`` placement "none": this mixer norms its own inputs). ``SharedBlock`` holds the
weights of the block (input_layernorm, the attention's q/k/v/o projections, pre_ff_layernorm, gate_up / down): the
hybrid layers that share one hold the same module, registered (so stored, loaded and exported) in the first of them
only; the others keep a reference that is not a submodule. Each use has its own adapters (the low-rank A_j, B_j of
q, k, v and of gate_up), its ``linear``, its Mamba2 layer and its own state: the Mamba2 layer's "S" and "conv", the
attention's KV cache "key", "value", "pos" (edgelin.layers.attention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.attention import Attention, AttentionOptions
from edgelin.layers.mamba2 import Mamba2Mixer, Mamba2Options
from edgelin.layers.norms import RMSNorm
from edgelin.state import State

ACTIVATIONS = ("gelu", "silu")  # transformers' ACT2FN names: "gelu" is the exact (erf) GELU


@dataclass(frozen=True)
class SharedBlockOptions:
    d_model: int  # d: the block reads [x, e] (2 d) and writes d
    num_heads: int
    num_kv_heads: int
    mlp_hidden: int  # I: gate_up is d -> 2 I
    norm_eps: float
    rope_theta: float = 10000.0
    rope: bool = False  # RoPE on the whole head (use_mem_rope)
    activation: str = "gelu"
    mlp_bias: bool = False  # biases on gate_up and down (add_bias_linear)
    adapter_rank: int = 128
    attention_adapters: bool = False  # adapters on q, k, v (use_shared_attention_adapter); gate_up's are always there

    @property
    def head_dim(self) -> int:
        return 2 * self.d_model // self.num_heads

    def attention(self) -> AttentionOptions:
        D = self.head_dim
        return AttentionOptions(
            d_model=2 * self.d_model, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=D,
            rope_theta=self.rope_theta, rotary_dim=D if self.rope else 0, norm_eps=self.norm_eps, scale=(D / 2) ** -0.5,
            out_dim=self.d_model,
        )


def act(name: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' ACT2FN[name](x) with portable operators (the exact GELU through Erf)."""
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    return F.silu(x)


def adapter(width_in: int, rank: int, width_out: int) -> nn.Sequential:
    """A low-rank adapter x -> B A x (transformers' nn.Sequential of two Linears without bias)."""
    return nn.Sequential(nn.Linear(width_in, rank, bias=False), nn.Linear(rank, width_out, bias=False))


class SharedMLP(nn.Module):
    """down(act(g) * u), [g, u] = gate_up(x) + delta: transformers' Zamba2MLP without its adapters (the uses hold them)."""

    def __init__(self, o: SharedBlockOptions) -> None:
        super().__init__()
        self.activation = o.activation
        self.gate_up_proj = nn.Linear(o.d_model, 2 * o.mlp_hidden, bias=o.mlp_bias)
        self.down_proj = nn.Linear(o.mlp_hidden, o.d_model, bias=o.mlp_bias)

    def forward(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + delta).chunk(2, dim=-1)  # [B, T, I] each
        return self.down_proj(act(self.activation, gate) * up)


class SharedBlock(nn.Module):
    """The weights one or more hybrid layers share (transformers' Zamba2AttentionDecoderLayer without the adapters)."""

    def __init__(self, o: SharedBlockOptions) -> None:
        super().__init__()
        if o.activation not in ACTIVATIONS:
            raise ValueError(f"the shared MLP's activation must be one of {', '.join(ACTIVATIONS)}, got {o.activation!r}")
        if (2 * o.d_model) % o.num_heads:
            raise ValueError(f"num_heads ({o.num_heads}) must divide 2 d_model ({2 * o.d_model})")
        self.o = o
        self.input_layernorm = RMSNorm(2 * o.d_model, o.norm_eps)
        self.self_attn = Attention(o.attention())
        self.pre_ff_layernorm = RMSNorm(o.d_model, o.norm_eps)
        self.feed_forward = SharedMLP(o)


class _Reference:
    """A module held without registering it (not a submodule: its parameters belong to the module that registers it)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module


@register_mixer("zamba2/hybrid")
class Zamba2Hybrid(nn.Module):
    """One use of a shared block, then its Mamba2 layer (module docstring). ``owner``: this use registers ``shared``
    (the first use of each shared block); the others only refer to it. Forms: those of attention and Mamba2."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False  # (the attention's right-aligned cache)
    bounded_state = True  # a KV cache of activations and Mamba2's decaying state
    reads_embeddings = True  # called with embeddings= the model's input embeddings

    def __init__(self, shared: SharedBlock, mamba: Mamba2Options, *, owner: bool) -> None:
        super().__init__()
        o = shared.o
        if owner:
            self.shared = shared
        else:
            self._shared = _Reference(shared)
        width, kv_width = 2 * o.d_model, o.num_kv_heads * o.head_dim
        if o.attention_adapters and kv_width != width:
            raise ValueError(f"attention adapters write 2 d_model ({width}) features; k and v have {kv_width} "
                             "(num_kv_heads < num_heads): use adapters without grouped heads")
        rank = o.adapter_rank
        self.q_adapter = adapter(width, rank, width) if o.attention_adapters else None
        self.k_adapter = adapter(width, rank, width) if o.attention_adapters else None
        self.v_adapter = adapter(width, rank, width) if o.attention_adapters else None
        self.mlp_adapter = adapter(o.d_model, rank, 2 * o.mlp_hidden)
        self.linear = nn.Linear(o.d_model, o.d_model, bias=False)
        self.input_layernorm = RMSNorm(o.d_model, o.norm_eps)
        self.mamba = Mamba2Mixer(mamba)

    @property
    def block(self) -> SharedBlock:
        """The shared block (owned here or referred to)."""
        return self.shared if "shared" in self._modules else self._shared.module

    def state_layout(self) -> dict[str, tuple]:
        return {**self.mamba.state_layout(), **self.block.self_attn.state_layout()}

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None, embeddings: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, State]:
        """x, embeddings [B, T, d] -> (y [B, T, d] the Mamba2 layer's output, the new state)."""
        check_form(self, form, lengths)
        if embeddings is None:
            raise ValueError("a zamba2/hybrid layer reads the model's input embeddings (embeddings=)")
        block = self.block
        h = block.input_layernorm(torch.cat([x, embeddings], dim=-1))  # [B, T, 2 d]
        deltas = None
        if self.q_adapter is not None:
            deltas = (self.q_adapter(h), self.k_adapter(h), self.v_adapter(h))  # [B, T, 2 d] each
        cache = {name: state[name] for name in ("key", "value", "pos")}
        a, cache = block.self_attn(h, cache, form=form, chunk_size=chunk_size, deltas=deltas)  # [B, T, d]
        a = block.pre_ff_layernorm(a)
        m = self.linear(block.feed_forward(a, self.mlp_adapter(a)))  # [B, T, d]
        ssm = {"S": state["S"], "conv": state["conv"]}
        y, ssm = self.mamba(self.input_layernorm(x + m), ssm, form=form, chunk_size=chunk_size)
        return y, {**ssm, **cache}


__all__ = ["ACTIVATIONS", "SharedBlock", "SharedBlockOptions", "SharedMLP", "Zamba2Hybrid", "act", "adapter"]
