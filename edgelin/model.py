"""LinearLM: a decoder-only language model whose attention is linear (kernelised).

    tokens -> embedding -> n_layers x [RMSNorm -> linear attention -> + -> RMSNorm -> SwiGLU -> +] -> RMSNorm -> LM head

Two ways to run it, with the same weights and the same state:
- ``forward(input_ids, state)``: the whole sequence at once (chunked parallel form): the prefill graph;
- ``step(input_ids[B, 1], state)``: one token with a fixed-size state (the "step" form): the decode graph.
The two differ only in the attention form; ``LinearLM`` implements the model protocol (edgelin.protocol).

The state is a flat ordered dict "{layer}.{name}" -> tensor (names: S, z, pos, conv) whose contract
``state_specs()`` declares; the exporter turns each key into graph input ``state.{key}`` and output
``present.{key}``.

A decay (``cfg.decay``, registry ``edgelin.layers.linear_attention.DECAYS``) makes the state forget: each layer computes a log-decay g
<= 0 from its input and hands it to the attention form (edgelin.ops), S_t = exp(g_t) S_{t-1} + phi(k_t)
v_t^T. g is a constant or a function of the current token only, so a decay adds no state. With decay
"none" the model has exactly the modules, weights, state and graphs it has without the field.

The delta rule (``cfg.update = "delta"``, edgelin.ops.delta) replaces what the state holds for a key instead of
adding to it: S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, with k = l2norm(phi(k)), q likewise
(scaled by F^-1/2), beta = sigmoid(W_beta x) per head and token, and alpha = exp(g) from the layer's decay (none:
DeltaNet; "scalar": Gated DeltaNet's gate). With "additive" (the default) nothing of this exists.
"""

from __future__ import annotations

from torch import nn

from edgelin.config import ModelConfig
from edgelin.layers.linear_attention import LinearAttention
from edgelin.skeleton import CausalLM, init_weights


class LinearLM(CausalLM):
    """The skeleton configured from a ``ModelConfig``: every layer linear attention (``cfg.attn_layers`` softmax
    attention with a KV cache, edgelin.layers.attention), SwiGLU MLPs, GPT-2 init."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        super().__init__(
            lambda i: make_layer(cfg, i), n_layers=cfg.n_layers, vocab_size=cfg.vocab_size, d_model=cfg.d_model,
            mlp_hidden=cfg.mlp_hidden, norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings,
            chunk_size=cfg.chunk_size, config=cfg.to_dict(),
        )
        self.max_positions = cfg.max_positions or None
        init_weights(self)

    def model_config(self) -> dict:
        """The config, recorded as the manifest's "model" field."""
        return self.cfg.to_dict()

    def with_chunk_size(self, chunk_size: int) -> "LinearLM":
        model = super().with_chunk_size(chunk_size)
        if model is not self:
            model.cfg = self.cfg.replace(chunk_size=chunk_size)
            model.config = model.cfg.to_dict()
        return model


def make_layer(cfg: ModelConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s mixer: softmax attention at ``cfg.attn_layers``, linear attention elsewhere."""
    if layer in cfg.attn_layers:
        from edgelin.layers.attention import attention_from_config

        return attention_from_config(cfg)
    return LinearAttention(cfg, layer)


__all__ = ["LinearLM", "make_layer"]
