"""A model that follows edgelin.protocol by delegating to another one, and declares nothing optional of its own:
no cfg, init_state, with_chunk_size, accepts_lengths or accepts_logits_at (what a user's own module may lack)."""

from __future__ import annotations

import torch


class Delegating(torch.nn.Module):
    """The protocol's members, each ``inner``'s; the optional flags left undeclared."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def chunk_size(self) -> int:
        return self.inner.chunk_size

    def forward(self, input_ids, state=None):
        return self.inner(input_ids, state)

    def step(self, input_ids, state):
        return self.inner.step(input_ids, state)

    def state_specs(self):
        return self.inner.state_specs()

    def model_config(self) -> dict:
        return self.inner.model_config()
