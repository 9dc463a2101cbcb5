"""Softmax attention with a KV cache: the mixer kind "attention" of hybrid stacks (edgelin.skeleton).

State per layer (the KV cache, a state that grows along the sequence):

    key   [B, H_kv, P, D]    keys after RoPE (and the k norm), oldest first
    value [B, H_kv, P, Dv]
    pos   [B] int64          tokens this row has seen (the absolute position of its next token)

P is the manifest's symbol "past": 0 for a fresh sequence, P + T after a call of T tokens, at most the window W
when the layer has one (``window``: each query sees itself and the W - 1 positions before it; the cache keeps
the last W positions, so the state stops growing at W).

One rule masks everything. Slot j of row b (j over the P cached then the T new positions) holds the token at
absolute position a_j = pos_b - P + j: the cache is right-aligned, so rows of different lengths can share one
batch with their caches left-padded (slots with a_j < 0 are padding). Query t (absolute pos_b + t) sees slot j
iff 0 <= a_j <= pos_b + t and, with a window, pos_b + t - a_j < W. Queries of a key/value group share one MatMul
against the cache (grouped heads are never expanded).

RoPE rotates halves (GPT-NeoX / fla / transformers' rotate_half), at absolute positions, over the first
``rotary_dim`` features of each head (partial rotary), with inv_freq = theta^(-2i / rotary_dim) in float32;
``proportional_rope`` (transformers' "proportional" type) instead rotates the whole head by halves with
inv_freq = theta^(-2i / head_dim) for i < rotary_dim / 2 and 0 for the rest (those pairs pass unchanged).
Options: biases on q/k/v (``qkv_bias``), per-head RMSNorms on q and k before RoPE (``qk_norm``; with a unit
offset, x / rms(x) * (1 + w), by ``unit_offset_norm`` as Qwen3.5's), and Qwen's output gate (``output_gate``:
o * sigmoid(W_g x) before o_proj; ``packed_gate``: W_g's rows inside q_proj, per head [q_h | gate_h], as Qwen3.5
stores them); LFM3's gate per head (``head_gate``: o_h * sigmoid(w_h . x), one gate value per head); q/k norms over
the whole projection instead of each head (``qk_norm_whole``: OLMo's, an RMSNorm of width H D and H_kv D before
the heads are split); a bias on o_proj (``o_bias``). Only portable operators (Concat, Slice, MatMul, Softmax,
Where): the graphs run in every runtime edgelin has. Under the fused lowering (edgelin.ops.fused) a decode step's
attention is one ``com.microsoft.GroupQueryAttention`` node with this mask rule as its additive bias; the cache
keeps this layout, so the state contract is the same.

What depends only on the positions is computed once per call, not once per layer: the first attention layer of a
call puts its positions, RoPE angles (per rotary width, theta and dtype) and mask (per window: the layers of one
window hold caches of one length) in the skeleton's per-call ``carry``, and the later layers read them there. Every
attention layer's ``pos`` holds the same count (each call adds T to all of them), so the values are the ones each
layer would compute from its own; each layer still returns its own ``pos + T``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.layers import check_form, register_mixer
from edgelin.layers.norms import RMSNorm, UnitOffsetRMSNorm
from edgelin.ops import fused
from edgelin.state import State

PAST = "past"  # the manifest's symbol for the positions a growing state holds


@dataclass(frozen=True)
class AttentionOptions:
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # None: the whole head
    window: int | None = None  # None: the whole context
    qkv_bias: bool = False
    qk_norm: bool = False
    output_gate: bool = False
    norm_eps: float = 1e-6
    packed_gate: bool = False  # the output gate's rows inside q_proj, per head [q_h | gate_h] (Qwen3.5, Qwen3-Next)
    scale: float | None = None  # the softmax scale; None: head_dim^-0.5 (Granite: attention_multiplier)
    unit_offset_norm: bool = False  # the q/k norms are UnitOffsetRMSNorm: x / rms(x) * (1 + w) (Qwen3.5)
    head_gate: bool = False  # an output gate of one value per head: g_proj d_model -> H (LFM3's use_attention_gate)
    qk_norm_whole: bool = False  # with qk_norm: the norms span the whole q / k projection, not each head (OLMo)
    o_bias: bool = False  # a bias on o_proj
    out_dim: int | None = None  # o_proj's output width; None: d_model (Zamba2's shared attention reads 2 d_model, writes d_model)
    proportional_rope: bool = False  # the whole head rotated: theta^(-2i / head_dim) for i < rotary_dim / 2, 0 after (LFM3)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i / rotary_dim), i < rotary_dim / 2, float32 (as fla and transformers compute it)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, len(inv_freq)] in ``dtype`` of the angles positions [B, T] x inv_freq, computed in float32 whatever
    the model's dtype (a float64 copy too): the convention checkpoints have."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)  # [B, T, r / 2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, fused_node: bool = False) -> torch.Tensor:
    """RoPE by halves on the first 2 * len(inv_freq) features: x [B, h, T, D], positions [B, T] int64. ``fused_node``: as one
    com.microsoft.RotaryEmbedding node under the fused lowering (``edgelin.ops.fused``; the same values)."""
    cos, sin = rope_angles(positions, inv_freq, x.dtype)  # [B, T, r / 2]
    return rotate_by(x, cos, sin, fused_node=fused_node)


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused_node: bool = False) -> torch.Tensor:
    """``rotate`` at angles already computed: cos, sin [B, T, r / 2] (``rope_angles``)."""
    if fused_node and fused.active():
        return fused.rotary_embedding(x, cos, sin)
    return fused.rotate_halves(x, cos[:, None], sin[:, None])


def cache_mask(pos: torch.Tensor, past: int | torch.SymInt, T: int | torch.SymInt, window: int | None) -> torch.Tensor:
    """[B, 1, T, P + T] bool: query t of row b may read slot j (module docstring)."""
    device = pos.device
    slot = pos[:, None] - past + torch.arange(past + T, device=device)[None, :]  # [B, P + T] absolute position of slot j
    query = pos[:, None] + torch.arange(T, device=device)[None, :]  # [B, T]
    seen = (slot[:, None, :] >= 0) & (slot[:, None, :] <= query[:, :, None])  # [B, T, P + T]
    if window is not None:
        seen = seen & (query[:, :, None] - slot[:, None, :] < window)
    return seen[:, None]  # [B, 1, T, P + T]


@register_mixer("attention")
class Attention(nn.Module):
    """Softmax attention over a KV cache (module docstring). Forms: "chunk" (any T: the prefill graph) and
    "step" (T = 1: the decode graph) run the same code; "naive" is a per-query float64-friendly loop."""

    forms = ("chunk", "step", "naive")
    accepts_lengths = False  # a right-padded ragged batch would put padding inside the right-aligned cache
    bounded_state = True  # keys and values are activations, not running sums: float16 holds them
    uses_carry = True  # the positions, RoPE angles and masks of a call, shared by its attention layers (module docstring)

    def __init__(self, o: AttentionOptions) -> None:
        super().__init__()
        if o.num_heads % o.num_kv_heads:
            raise ValueError(f"num_kv_heads ({o.num_kv_heads}) must divide num_heads ({o.num_heads})")
        self.o = o
        self.groups = o.num_heads // o.num_kv_heads
        rotary = o.head_dim if o.rotary_dim is None else o.rotary_dim
        if rotary % 2 or not 0 <= rotary <= o.head_dim:
            raise ValueError(f"the rotary width must be even and in [0, head_dim = {o.head_dim}] (0: no RoPE), got {rotary}")
        self.rotary = rotary
        self.scale = o.head_dim**-0.5 if o.scale is None else o.scale
        packed = o.output_gate and o.packed_gate
        self.q_proj = nn.Linear(o.d_model, o.num_heads * o.head_dim * (2 if packed else 1), bias=o.qkv_bias)
        self.k_proj = nn.Linear(o.d_model, o.num_kv_heads * o.head_dim, bias=o.qkv_bias)
        self.v_proj = nn.Linear(o.d_model, o.num_kv_heads * o.head_dim, bias=o.qkv_bias)
        if o.head_gate and o.output_gate:
            raise ValueError("an attention layer has one output gate: per element (output_gate) or per head (head_gate)")
        self.o_proj = nn.Linear(o.num_heads * o.head_dim, o.d_model if o.out_dim is None else o.out_dim, bias=o.o_bias)
        gate_width = o.num_heads if o.head_gate else o.num_heads * o.head_dim
        self.g_proj = nn.Linear(o.d_model, gate_width, bias=False) if (o.output_gate and not packed) or o.head_gate else None
        norm = UnitOffsetRMSNorm if o.unit_offset_norm else RMSNorm
        whole = o.qk_norm_whole
        self.q_norm = norm(o.head_dim * (o.num_heads if whole else 1), o.norm_eps) if o.qk_norm else None
        self.k_norm = norm(o.head_dim * (o.num_kv_heads if whole else 1), o.norm_eps) if o.qk_norm else None
        inv_freq = rope_inv_freq(rotary, o.rope_theta)  # [rotary / 2]
        if o.proportional_rope and 0 < rotary < o.head_dim:  # [head_dim / 2]: a zero frequency leaves its pair as it is
            inv_freq = torch.cat([rope_inv_freq(o.head_dim, o.rope_theta)[: rotary // 2], torch.zeros((o.head_dim - rotary) // 2)])
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def state_layout(self) -> dict[str, tuple]:
        o = self.o
        return {
            "key": (("batch", o.num_kv_heads, PAST, o.head_dim), "float32", 0.0, o.window),
            "value": (("batch", o.num_kv_heads, PAST, o.head_dim), "float32", 0.0, o.window),
            "pos": (("batch",), "int64", 0),
        }

    def _rope(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor] | None, step: bool) -> torch.Tensor:
        # rotary width 0: no position encoding; a fused decode step rotates in one node, as its attention is one
        return x if angles is None else rotate_by(x, *angles, fused_node=step)

    def _shared(self, carry: dict | None, key: tuple, make):
        """``make()``, once per call for all the attention layers that ask with the same key (module docstring)."""
        if carry is None:
            return make()
        key = ("attention",) + key
        if key not in carry:
            carry[key] = make()
        return carry[key]

    def _heads(self, x: torch.Tensor, heads: int, norm: RMSNorm | None) -> torch.Tensor:
        B, T, _ = x.shape
        if norm is not None and self.o.qk_norm_whole:
            x = norm(x)  # [B, T, h D]: one norm over the whole projection
        x = x.view(B, T, heads, self.o.head_dim)  # [B, T, h, D]
        if norm is not None and not self.o.qk_norm_whole:
            x = norm(x)
        return x.transpose(1, 2)  # [B, h, T, D]

    def forward(
        self, x: torch.Tensor, state: State, *, form: str = "chunk", chunk_size: int | None = None,
        lengths: torch.Tensor | None = None, deltas: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        carry: dict | None = None,
    ) -> tuple[torch.Tensor, State]:
        """``deltas``: (dq [B, T, H D], dk, dv [B, T, H_kv D]) added to the q, k, v projections of ``x`` (the per-use
        adapters of an attention whose weights several layers share: Zamba2's shared block). ``carry``: the skeleton's
        per-call dict, where the attention layers of a call share what depends on the positions only."""
        check_form(self, form, lengths)
        o = self.o
        B, T, _ = x.shape
        pos = state["pos"]  # [B]
        first = self._shared(carry, ("pos",), lambda: pos)  # the first attention layer's: the same count as this one's
        positions = self._shared(carry, ("positions",), lambda: first[:, None] + torch.arange(T, device=x.device)[None, :])  # [B, T]
        angles = None if self.rotary == 0 else self._shared(
            carry, ("angles", self.rotary, o.head_dim, o.rope_theta, o.proportional_rope, x.dtype),
            lambda: rope_angles(positions, self.inv_freq, x.dtype))  # cos, sin [B, T, r / 2]
        past = state["key"].shape[2]
        seen = self._shared(carry, ("mask", o.window), lambda: cache_mask(first, past, T, o.window))  # [B, 1, T, P + T]
        q, gate = self.q_proj(x), None  # [B, T, H D] (packed: [B, T, H 2D])
        if o.output_gate and o.packed_gate:
            q, gate = q.view(B, T, o.num_heads, 2 * o.head_dim).chunk(2, dim=-1)  # [B, T, H, D] each
            q, gate = q.reshape(B, T, o.num_heads * o.head_dim), gate.reshape(B, T, o.num_heads * o.head_dim)
        elif self.g_proj is not None:
            gate = self.g_proj(x)  # [B, T, H D]
        if deltas is not None:
            q = q + deltas[0]
        q = self._rope(self._heads(q, o.num_heads, self.q_norm), angles, form == "step")  # [B, H, T, D]
        k, v = (self.k_proj(x), None) if deltas is None else (self.k_proj(x) + deltas[1], self.v_proj(x) + deltas[2])
        k = self._rope(self._heads(k, o.num_kv_heads, self.k_norm), angles, form == "step")  # [B, Hkv, T, D]
        v = self._heads(self.v_proj(x) if v is None else v, o.num_kv_heads, None)  # [B, Hkv, T, D]
        if form == "step" and fused.active():  # one GroupQueryAttention node (edgelin.ops.fused); T = 1: Reshapes only
            bias = self._shared(carry, ("bias", o.window, q.dtype), lambda: fused.attention_bias(seen, q.dtype))
            y, keys, values = fused.group_query_attention(
                q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1), state["key"], state["value"],
                bias, o.num_heads, o.num_kv_heads, self.scale,
            )  # [B, T, H D], [B, Hkv, P + T, D] x 2
        else:
            keys = torch.cat([state["key"], k], dim=2)  # [B, Hkv, P + T, D]
            values = torch.cat([state["value"], v], dim=2)  # [B, Hkv, P + T, D]
            y = self._naive(q, keys, values, seen) if form == "naive" else self._grouped(q, keys, values, seen)  # [B, H, T, D]
            y = y.transpose(1, 2).reshape(B, T, o.num_heads * o.head_dim)  # [B, T, H D]
        if gate is not None and o.head_gate:  # one value per head: [B, T, H] over each head's D features
            y = (y.view(B, T, o.num_heads, o.head_dim) * torch.sigmoid(gate)[..., None]).reshape(B, T, o.num_heads * o.head_dim)
        elif gate is not None:
            y = y * torch.sigmoid(gate)
        if o.window is not None:  # keep the last W positions (all of them while fewer)
            keys, values = keys[:, :, -o.window :], values[:, :, -o.window :]
        return self.o_proj(y), {"key": keys, "value": values, "pos": pos + T}

    def _grouped(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The queries of each key/value group in one MatMul: [B, Hkv, G T, D] x [B, Hkv, D, P + T]."""
        B, H, T, D = q.shape
        Hkv, G = self.o.num_kv_heads, self.groups
        scores = (q.reshape(B, Hkv, G * T, D) @ keys.transpose(2, 3)) * self.scale  # [B, Hkv, G T, P + T]
        scores = scores.view(B, Hkv, G, T, -1)
        scores = torch.where(seen[:, :, None], scores, torch.tensor(float("-inf"), dtype=scores.dtype))  # [B, Hkv, G, T, P + T]
        weights = torch.softmax(scores, dim=-1).reshape(B, Hkv, G * T, -1)
        return (weights @ values).reshape(B, H, T, D)  # [B, H, T, D]

    def _naive(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """One query head and position at a time, keys of its group picked by index: the slow reference."""
        B, H, T, D = q.shape
        out = torch.zeros_like(q)
        for b in range(B):
            for h in range(H):
                kv = h // self.groups
                for t in range(T):
                    mask = seen[b, 0, t]  # [P + T]
                    s = (keys[b, kv][mask] @ q[b, h, t]) * self.scale  # [n]
                    out[b, h, t] = torch.softmax(s, dim=0) @ values[b, kv][mask]
        return out


def attention_from_config(cfg) -> Attention:
    """The attention layer of a LinearLM hybrid (``cfg.attn_layers``; edgelin.config)."""
    return Attention(AttentionOptions(
        d_model=cfg.d_model, num_heads=cfg.n_heads, num_kv_heads=cfg.attn_kv_heads or cfg.n_heads, head_dim=cfg.head_dim,
        rope_theta=float(cfg.rope_theta), window=cfg.attn_window or None, norm_eps=cfg.norm_eps,
    ))


def sdpa_reference(q, k, v, *, window: int | None = None, groups: int = 1) -> torch.Tensor:
    """Causal softmax attention over whole sequences in float64 with torch's SDPA: q [B, H, T, D], k, v
    [B, H / groups, T, D] (positions 0..T-1, keys already rotated); the independent check of the cache."""
    T = q.shape[2]
    i = torch.arange(T)
    mask = i[None, :] <= i[:, None]
    if window is not None:
        mask = mask & (i[:, None] - i[None, :] < window)
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


__all__ = ["Attention", "AttentionOptions", "PAST", "attention_from_config", "cache_mask", "rope_angles", "rope_inv_freq", "rotate", "rotate_by",
           "sdpa_reference"]
