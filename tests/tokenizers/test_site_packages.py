"""`edgelin web` names every npm package a site needs and lacks in one line, with one `npm install` command (issue 59):
not one per run."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from edgelin.errors import RuntimeInputError
from edgelin.web import write_site

BOTH = ("onnxruntime-web and @huggingface/tokenizers are not installed ({a}; {b}); install them once with "
        "`npm install onnxruntime-web@1.31.1 @huggingface/tokenizers@0.2.0` and pass --ort-web node_modules/onnxruntime-web "
        "(or set EDGELIN_ORT_WEB) and --tokenizers-js node_modules/@huggingface/tokenizers (or set EDGELIN_TOKENIZERS_JS)")


def test_both_missing_packages_are_named_at_once(hf_export, tmp_path):
    """An export with a Hugging Face tokenizer needs onnxruntime-web and @huggingface/tokenizers: neither installed,
    both are named, with one command."""
    export = hf_export("bytelevel")
    ort, tok = tmp_path / "no-ort", tmp_path / "no-tok"
    with pytest.raises(RuntimeInputError) as err:
        write_site(export, tmp_path / "site", ort_web=ort, tokenizers_js=tok)
    assert str(err.value) == BOTH.format(a=f"onnxruntime-web: {ort}", b=f"@huggingface/tokenizers: {tok}")
    assert not (tmp_path / "site").exists()


def test_the_cli_says_both_in_one_line(hf_export, tmp_path, monkeypatch):
    from edgelin.cli import main

    monkeypatch.setenv("EDGELIN_ORT_WEB", str(tmp_path / "none"))
    monkeypatch.setenv("EDGELIN_TOKENIZERS_JS", str(tmp_path / "none"))
    r = CliRunner().invoke(main, ["web", str(hf_export("bytelevel")), "-o", str(tmp_path / "site")])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert "npm install onnxruntime-web@1.31.1 @huggingface/tokenizers@0.2.0" in r.output, r.output
