"""API misuse with a path that cannot be one -- None, a number, a NUL in the name -- is an EdgelinError of one line
(the project's rule), never a TypeError or ValueError from deep inside: Session/load, Manifest.load, check, the site
writer, state files, export and its options."""

from __future__ import annotations

import pytest

from edgelin.errors import EdgelinError

BAD = {"none": None, "number": 3, "nul": "a\x00b"}


def _refused(fn, bad):
    with pytest.raises(EdgelinError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg and ("holds a NUL character" in msg if bad == "nul" else "must be a path" in msg), msg


@pytest.mark.parametrize("bad", list(BAD))
def test_reading_an_export(tiny, bad):
    from edgelin.runtime import Session, golden, load
    from edgelin.runtime.manifest import Manifest

    for fn in (lambda: load(BAD[bad], provider="cpu"), lambda: Session(BAD[bad]), lambda: Manifest.load(BAD[bad]),
               lambda: golden.check(BAD[bad], ["cpu"])):
        _refused(fn, bad)


@pytest.mark.parametrize("bad", ["nul"])
def test_the_optimised_graphs_folder(tiny, bad):
    from edgelin.runtime import load

    _refused(lambda: load(tiny[1], provider="cpu", save_optimized=BAD[bad]), bad)


@pytest.mark.parametrize("bad", list(BAD))
def test_the_site_writer(tiny, bad, tmp_path):
    from edgelin.web import write_site

    _refused(lambda: write_site(BAD[bad], tmp_path / "site", ort_web=tmp_path), bad)
    _refused(lambda: write_site(tiny[1], BAD[bad], ort_web=tmp_path), bad)


@pytest.mark.parametrize("bad", ["nul"])
def test_state_files(session, bad, tmp_path):
    state = session.new_state(1)
    _refused(lambda: state.save(str(tmp_path / BAD[bad])), bad)
    _refused(lambda: session.load_state(str(tmp_path / BAD[bad])), bad)


@pytest.mark.parametrize("bad", list(BAD))
def test_export_paths(tiny, trace_cache, bad, tmp_path):
    from edgelin.exporters import export

    model = tiny[0]
    _refused(lambda: export(model, BAD[bad], check=False), bad)
    if bad != "none":  # None is the default of these options
        _refused(lambda: export(model, tmp_path / "out", trace_cache=BAD[bad], check=False), bad)
        _refused(lambda: export(model, tmp_path / "out", tokenizer=BAD[bad], check=False), bad)
    if bad == "nul":
        _refused(lambda: export(BAD[bad], tmp_path / "out", check=False), bad)
    assert list(tmp_path.iterdir()) == []
