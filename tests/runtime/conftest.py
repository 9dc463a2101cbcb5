"""Tiny models, exported once per test session (one per feature map), for the runtime tests."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from edgelin.config import ModelConfig
from edgelin.model import LinearLM

FEATURE_MAPS = ["identity", "elu+1", "relu", "softplus", "performer", "cosformer"]
WEIGHT_SCALE = 15.0  # at init scale greedy decoding repeats one token; sharper weights give varied streams


def tiny_model(feature_map: str = "elu+1", seed: int = 0, **overrides) -> LinearLM:
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16, feature_map=feature_map,
        normalisation="none" if feature_map == "identity" else "denominator",
    )
    cfg = ModelConfig(**(cfg | overrides))
    model = LinearLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(WEIGHT_SCALE)
    return model


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread():
    """Exports and PyTorch references of tiny models: torch's thread pool only costs time on 2 shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """(feature map, config overrides) -> (model, export dir); each exported once per session."""
    from edgelin.exporters import export

    cache: dict[tuple, tuple] = {}

    def get(feature_map: str = "elu+1", **overrides):
        key = (feature_map, tuple(sorted(overrides.items())))
        if key not in cache:
            model = tiny_model(feature_map, **overrides)
            out = tmp_path_factory.mktemp("runtime-export") / feature_map.replace("+", "p")
            export(model, out, check=False)
            cache[key] = (model, out)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny(exported):
    """(model, export dir) of the elu+1 model, the default for most tests."""
    return exported("elu+1")


@pytest.fixture(scope="session")
def session(tiny):
    """A CPU session of the elu+1 export, shared by tests that only read from it."""
    from edgelin.runtime import load

    return load(tiny[1], provider="cpu")


@pytest.fixture
def export_copy(tiny, tmp_path):
    """A private copy of the elu+1 export that a test may break."""
    dst = tmp_path / "export"
    shutil.copytree(tiny[1], dst)
    return dst


@pytest.fixture(autouse=True)
def _no_provider_warnings():
    from edgelin.runtime import ProviderWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProviderWarning)  # "auto" on a machine without CUDA; asserted where it matters
        yield
