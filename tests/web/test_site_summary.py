"""`edgelin web`'s summary gives the state per sequence as `edgelin export` does: a KV cache's bytes per position of
context too (issue 59)."""

from __future__ import annotations

from edgelin.runtime.manifest import Manifest
from edgelin.web import ORT_FILES, write_site


def test_a_growing_states_bytes_per_position_are_said(exported, tmp_path):
    # a hybrid: layer 1 softmax attention with a KV cache of at most 16 positions (a growing state)
    export = exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=16)[1]
    m = Manifest.load(export)
    ort = tmp_path / "ort"
    ort.mkdir()
    for f in ORT_FILES:
        (ort / f).write_text("x")  # the site is not run here: only its summary is read
    summary = write_site(export, tmp_path / "site", ort_web=ort).summary()
    per = m.state_bytes(1, 1) - m.state_bytes(1)
    line = f"  state per sequence: {m.state_bytes(1):,} bytes + {per:,} bytes per position of context ({m.state_bytes(1, 4096):,} bytes at 4,096"
    assert line in summary, summary
    assert f"  state per sequence: {m.state_summary()}" in summary.splitlines()


def test_the_export_summary_says_the_same(exported):
    """One home for the figure: the export's summary line is the manifest's state_summary, as the site's."""
    from edgelin.exporters.exporter import ExportResult

    export = exported("elu+1", decay="scalar", attn_layers=(1,), attn_window=16)[1]
    m = Manifest.load(export)
    r = ExportResult(out_dir=export, manifest=m, files={}, nodes={}, seconds={})
    assert f"  state per sequence: {m.state_summary()}" in r.summary().splitlines()
