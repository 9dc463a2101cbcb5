"""Tiny models exported once per test session, one per feature map."""

from __future__ import annotations

import pytest
import torch

from edgelin.config import ModelConfig
from edgelin.model import LinearLM

CHUNK = 16
FEATURE_MAPS = ["identity", "elu+1", "relu", "softplus", "performer", "cosformer"]


def tiny_config(feature_map: str, **overrides) -> ModelConfig:
    cfg = dict(
        vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=CHUNK, feature_map=feature_map,
        normalisation="none" if feature_map == "identity" else "denominator",
        cosformer_horizon=2048,
    )
    cfg.update(overrides)
    return ModelConfig(**cfg)


def tiny_model(feature_map: str, seed: int = 0, **overrides) -> LinearLM:
    torch.manual_seed(seed)
    return LinearLM(tiny_config(feature_map, **overrides)).eval()


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """feature map -> (model, export dir); each exported once."""
    from edgelin.exporters import export

    cache: dict[str, tuple] = {}

    def get(feature_map: str):
        if feature_map not in cache:
            model = tiny_model(feature_map)
            out = tmp_path_factory.mktemp("export") / feature_map
            export(model, out)
            cache[feature_map] = (model, out)
        return cache[feature_map]

    return get
