"""Shared pytest set-up for the edgelin suite (test modules import nothing from each other)."""

import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: builds or installs something (e.g. the wheel); deselect with -m 'not slow'",
    )


@pytest.fixture(scope="module")
def torch_single_thread():
    """One intra-op thread for a module of many tiny tensor ops.

    On a 2-core machine shared with other work, torch's thread pool made these tests ~5x slower
    (threads wait on each other); tiny tensors gain nothing from it. Restored after the module.
    """
    import torch  # here, not at the top: torch-free test modules must not pay for (or see) torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
