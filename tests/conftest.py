"""Shared pytest set-up for the edgelin suite (test modules import nothing from each other; shared helpers
live in tests/testkit, on the path through pyproject's ``pythonpath``).

``exported(feature_map, **config_overrides)`` gives (model, export dir) of a tiny LinearLM and
``bundled_export(precision)`` an export of the bundled model; ``export_cache`` exports any other
configuration. Each configuration is exported once per run, shared by every xdist worker
(testkit.exports); a test that changes an export works on a copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit import stackchunks
from testkit.exports import ExportCache, count_traces, run_root, trace_summary


def pytest_configure(config):
    stackchunks.install()  # every test process (the controller and each xdist worker): CPython 3.11's gh-142183
    config.addinivalue_line(
        "markers",
        "slow: builds or installs something (e.g. the wheel, an export of the bundled model); deselect with -m 'not slow'",
    )


def _shared_root(config):
    return run_root(config._tmp_path_factory.getbasetemp())


def pytest_sessionstart(session):
    count_traces(_shared_root(session.config))


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller (or a run without xdist) checks once, after every worker
    changed = ExportCache(_shared_root(session.config)).untouched()
    if changed:
        session.config._edgelin_changed = changed
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(stackchunks.install())
    for line in trace_summary(_shared_root(config)):
        terminalreporter.write_line(line)
    if os.environ.get(KEPT_TRACES):
        terminalreporter.write_line(f"shared exports traced through {KEPT_TRACES}={os.environ[KEPT_TRACES]} (kept between runs): "
                                    "not a fresh run's time")
    for folder in getattr(config, "_edgelin_changed", []):
        terminalreporter.write_line(f"FAILED: a test wrote into the shared export {folder}; copy it first (testkit.exports.copy_of)")


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
def export_cache(tmp_path_factory) -> ExportCache:
    """``get(label, key, build)``: the folder ``build(folder)`` exported into, once per key in the whole run
    (every xdist worker shares it). The folder is shared: read it, or copy it (testkit.exports.copy_of)."""
    return ExportCache(run_root(tmp_path_factory.getbasetemp()))


KEPT_TRACES = "EDGELIN_TEST_TRACE_CACHE"  # a developer's trace cache kept between runs (never set by CI)


@pytest.fixture(scope="session")
def trace_cache(tmp_path_factory):
    """The run's trace cache (edgelin.exporters.traces), shared by every xdist worker: the cached exports of one
    model in several precisions (or with other checks or tokenizers) trace it once. Tests that change code a trace
    runs (a monkeypatched model) export without it. With EDGELIN_TEST_TRACE_CACHE=DIR the cache is DIR and outlives
    the run: a later run of unchanged code skips those traces (its key holds edgelin's sources and the models), and
    its time is then not a fresh run's."""
    kept = os.environ.get(KEPT_TRACES)
    return Path(kept).resolve() if kept else run_root(tmp_path_factory.getbasetemp()) / "traces"


@pytest.fixture(scope="session")
def export_of(export_cache, trace_cache):
    """``get(model, recipe, label=..., **export options)`` -> the export folder of ``model``, exported once per run.

    ``recipe`` is a JSON value that says how ``model`` was built (seed, config, ...): with the options it is the
    cache key, so two tests that build the same model the same way share one export. ``model`` may also be a
    checkpoint folder (its path is then the recipe's business)."""
    from edgelin.exporters import export

    def get(model, recipe, *, label: str = "model", **options):
        return export_cache.get(label, {"recipe": recipe, "options": options},
                                lambda folder: export(model, folder, trace_cache=trace_cache, **options))

    return get


@pytest.fixture(scope="session")
def exported(export_of):
    """(feature map, config overrides) -> (model, export dir) of ``tiny_model``; each exported once per run.

    ``options`` are export options (precision, state_dtype, ragged, chunk_size, check); by default the export
    is not smoke-checked (``check=False``), as the tests compare it with the model themselves."""
    models: dict[tuple, object] = {}

    def get(feature_map: str = "elu+1", *, options: dict | None = None, **overrides):
        key = (feature_map, tuple(sorted(overrides.items())))
        if key not in models:
            models[key] = tiny_model(feature_map, **overrides)  # deterministic: every worker builds the same weights
        model = models[key]
        recipe = {"tiny_model": [feature_map, sorted(overrides.items())], "scale": WEIGHT_SCALE, "config": model.model_config()}
        out = export_of(model, recipe, label=f"tiny-{feature_map.replace('+', 'p')}", **({"check": False} | (options or {})))
        return model, out

    return get


@pytest.fixture(scope="session")
def bundled_exports(export_cache, trace_cache):
    """(precision, **export options) -> export dir of the bundled model (models/stdlib-linear) in that precision, smoke-checked;
    each exported once per run (about 30 s each on a quiet 2-core machine). Skips where the install has no
    bundled model. (``bundled_export`` is the same; a folder may override that name, as tests/web does.)"""
    from edgelin.exporters import export
    from edgelin.models import bundled_checkpoint

    def get(precision: str = "fp32", **options):
        checkpoint = bundled_checkpoint()
        if checkpoint is None:
            pytest.skip("this install has no bundled model")
        key = {"checkpoint": str(checkpoint), "precision": precision} | ({"options": options} if options else {})
        return export_cache.get(f"bundled-{precision}", key, lambda folder: export(checkpoint, folder, precision=precision, trace_cache=trace_cache, **options))

    return get


@pytest.fixture(scope="session")
def bundled_export(bundled_exports):
    return bundled_exports


@pytest.fixture(scope="session", autouse=True)
def _warm_oracle_starts(tmp_path_factory):
    """The oracles' subprocesses (transformers' and fla's own models) forked from warm zygotes in this test process
    (testkit.zygote): the same scripts, minus 3-5 s of imports each. CLI runs of edgelin start theirs cold."""
    import subprocess

    from testkit.zygote import Router

    router = Router(subprocess.run, tmp_path_factory.mktemp("zygotes"))
    subprocess.run = router
    try:
        yield router
    finally:
        subprocess.run = router.real
        router.close()
