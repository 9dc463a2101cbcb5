"""Shared pytest set-up for the edgelin suite (test modules import nothing from each other).

``exported(feature_map, **config_overrides)`` gives (model, export dir) of a tiny LinearLM, exported
once per test session and shared by the exporter, runtime and parity tests.
"""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: builds or installs something (e.g. the wheel, an export of the bundled model); deselect with -m 'not slow'",
    )


WEIGHT_SCALE = 15.0  # at init scale greedy decoding repeats one token; sharper weights give varied streams


def tiny_model(feature_map: str = "elu+1", seed: int = 0, **overrides):
    """2 layers, d_model 32, 2 heads x 16, chunk 16, a conv of 4, byte vocab; weights scaled by WEIGHT_SCALE."""
    import torch

    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16, feature_map=feature_map,
        normalisation="none" if feature_map == "identity" else "denominator", conv_size=4,
    )
    cfg = ModelConfig(**(cfg | overrides))
    model = LinearLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(WEIGHT_SCALE)
            elif p.dim() == 3:  # the short conv starts as the identity: give it real taps
                p.add_(0.5 * torch.randn_like(p))
    return model


@pytest.fixture(scope="session", autouse=True)
def _torch_one_thread():
    """One intra-op thread for the whole suite: its tensors are tiny, and on a 2-core machine shared
    with other work torch's thread pool made tests ~5x slower (threads wait on each other)."""
    import torch

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
            out = tmp_path_factory.mktemp("export") / feature_map.replace("+", "p")
            export(model, out, check=False)
            cache[key] = (model, out)
        return cache[key]

    return get




@pytest.fixture(scope="session")
def bundled_export(tmp_path_factory):
    """precision -> export dir of the bundled model (models/stdlib-linear) in that precision; each exported
    once per session (about 30 s each on a quiet 2-core machine). Skips where the install has no bundled model."""
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint

    cache: dict[str, object] = {}

    def get(precision: str):
        checkpoint = bundled_checkpoint()
        if checkpoint is None:
            pytest.skip("this install has no bundled model")
        if precision not in cache:
            out = tmp_path_factory.mktemp("bundled") / precision
            export(checkpoint, out, precision=precision)
            cache[precision] = out
        return cache[precision]

    return get
