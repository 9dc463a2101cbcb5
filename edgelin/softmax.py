"""SoftmaxLM: the softmax-attention twin of LinearLM, a same-size reference for quality and speed.

    tokens -> embedding -> n_layers x [RMSNorm -> causal softmax attention (RoPE) -> + -> RMSNorm -> SwiGLU -> +] -> RMSNorm -> LM head

Same ModelConfig, same widths, same RMSNorm/SwiGLU, same init as LinearLM; only the attention differs:
softmax over all past keys, rotary positions (RoPE, rotate-half form), and a KV cache instead of a
fixed-size state. The feature-map fields of the config (feature_map, normalisation, chunk_size, ...)
are ignored.

The cache is a flat dict "{layer}.k" / "{layer}.v" -> [B, H, T_past, Dh]: ``forward(ids, cache)``
continues the sequence after the cached tokens and returns the grown cache.

Its weights use nanoGPT's fused ``qkv`` projection, so a SoftmaxLM checkpoint can never be loaded as a
LinearLM by mistake (``edgelin.checkpoint.load_checkpoint`` reports missing q_proj/k_proj/v_proj);
load it with ``load_softmax_checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgelin.config import ModelConfig
from edgelin.layers.mlp import SwiGLU
from edgelin.layers.norms import RMSNorm
from edgelin.skeleton import init_weights
from edgelin.protocol import select_positions

Cache = dict[str, torch.Tensor]
ROPE_BASE = 10000.0


def rope(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the angles of positions start .. start+T-1 (rotate-half RoPE)."""
    T, D = x.shape[-2], x.shape[-1]
    inv_freq = ROPE_BASE ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)  # [D/2]
    t = torch.arange(start, start + T, device=x.device, dtype=torch.float32)  # [T]
    angles = torch.outer(t, inv_freq)  # [T, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # [T, D/2] each
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]  # [B, H, T, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # [B, H, T, D]


class SoftmaxAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        inner = cfg.n_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, k_past: torch.Tensor | None, v_past: torch.Tensor | None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, H, T, Dh] each
        past = 0 if k_past is None else k_past.shape[2]
        q, k = rope(q, past), rope(k, past)
        if k_past is not None:
            k = torch.cat([k_past, k], dim=2)  # [B, H, past + T, Dh]
            v = torch.cat([v_past, v], dim=2)  # [B, H, past + T, Dh]
        if k_past is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
        else:  # query i sits at position past + i and sees keys 0 .. past + i
            mask = torch.arange(past + T, device=x.device)[None, :] <= (past + torch.arange(T, device=x.device))[:, None]  # [T, past + T]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, Dh]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), k, v  # [B, T, d_model]


class SoftmaxBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = SoftmaxAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, k_past, v_past):
        h, k, v = self.attn(self.attn_norm(x), k_past, v_past)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k, v


class SoftmaxLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(SoftmaxBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        init_weights(self)  # as LinearLM

    def forward(self, input_ids: torch.Tensor, cache: Cache | None = None, logits_at: torch.Tensor | None = None) -> tuple[torch.Tensor, Cache]:
        """input_ids [B, T] -> logits [B, T, vocab] (or, ``logits_at`` [B, P], those positions' only: [B, P, vocab]),
        the KV cache including these tokens."""
        x = self.embed(input_ids)  # [B, T, d_model]
        new_cache: Cache = {}
        for i, block in enumerate(self.blocks):
            k_past = None if cache is None else cache[f"{i}.k"]
            v_past = None if cache is None else cache[f"{i}.v"]
            x, new_cache[f"{i}.k"], new_cache[f"{i}.v"] = block(x, k_past, v_past)
        x = self.norm(x)
        if logits_at is not None:  # the head at the asked positions only, as edgelin's skeleton
            x = select_positions(x, logits_at)
        logits = x @ self.embed.weight.T if self.lm_head is None else self.lm_head(x)  # [B, T, vocab]
        return logits, new_cache

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_softmax_checkpoint(path: str | Path) -> SoftmaxLM:
    """Load a SoftmaxLM (eval mode, float32, CPU) saved by ``save_checkpoint`` (config.json + model.safetensors)."""
    from safetensors.torch import load_file

    from edgelin.checkpoint import WEIGHTS_FILE, load_config

    model = SoftmaxLM(load_config(path))
    model.load_state_dict(load_file(Path(path) / WEIGHTS_FILE, device="cpu"))  # strict: raises on any mismatch
    return model.float().eval()


__all__ = ["SoftmaxLM", "load_softmax_checkpoint", "rope"]
