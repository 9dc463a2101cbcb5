"""A folder (or a FIFO, or a link to nothing) where an export's file should be is named as such, not as missing."""

from __future__ import annotations

import os

import pytest

from edgelin.errors import ManifestError
from edgelin.runtime import golden, load


@pytest.mark.parametrize("name", ["weights.data", "decode.onnx"])
@pytest.mark.parametrize("kind", ["folder", "fifo", "dangling-link"])
def test_something_in_place_of_an_export_file_is_named(export_copy, name, kind):
    path = export_copy / name
    path.unlink()
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(export_copy / "gone")
    said = {"folder": "a folder", "fifo": "a FIFO, device or socket", "dangling-link": "a symbolic link to nothing"}[kind]
    with pytest.raises(ManifestError) as err:
        load(export_copy, provider="cpu")
    msg = str(err.value)
    assert f"has {said} in place of {name}" in msg and "lacks" not in msg and "\n" not in msg, msg


def test_a_folder_in_place_of_the_golden_file_is_named(export_copy):
    (export_copy / golden.GOLDEN_FILE).unlink()
    (export_copy / golden.GOLDEN_FILE).mkdir()
    with pytest.raises(ManifestError, match="has a folder in place of golden.json, named in edgelin.json"):
        golden.check(export_copy, ["cpu"], timing=False)


def test_a_folder_in_place_of_a_graph_is_named_by_the_site_writer(export_copy, tmp_path):
    from edgelin.web import write_site

    (export_copy / "prefill.onnx").unlink()
    (export_copy / "prefill.onnx").mkdir()
    with pytest.raises(ManifestError, match="has a folder in place of prefill.onnx, the prefill graph"):
        write_site(export_copy, tmp_path / "site", ort_web=tmp_path)
