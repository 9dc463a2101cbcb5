"""Runtime fixtures on top of the shared tiny exports (tests/conftest.py)."""

from __future__ import annotations

import shutil
import warnings

import pytest


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
