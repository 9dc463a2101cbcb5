"""The world a CLI case runs in (shared by the bad-input tables: tests/cli/test_bad_inputs.py and
tests/cli/test_nothing_lost.py)."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="module")
def sources(exported, export_cache):
    """A saved checkpoint of the tiny elu+1 model and its export (shared, never modified)."""
    from edgelin.checkpoint import save_checkpoint

    model, export_dir = exported("elu+1")
    ckpt = export_cache.get("cli-ckpt", "the tiny elu+1 model's checkpoint", lambda folder: save_checkpoint(model, folder))
    return ckpt, export_dir


@pytest.fixture
def world(sources, tmp_path, monkeypatch):
    """A fresh working folder holding models/ckpt, export/, docs/thesis.txt (a user's file), file.txt."""
    ckpt, export_dir = sources
    shutil.copytree(ckpt, tmp_path / "models" / "ckpt")
    shutil.copytree(export_dir, tmp_path / "export")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.txt").write_text("years of work\n")
    (tmp_path / "file.txt").write_text("a file\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path
