"""The README's code runs as written: its Python blocks against a tiny export with a Hugging Face tokenizer and a
chat template (this folder's ``chat_export``, standing in for the quick start's ``lfm2-onnx/``), its shell blocks
name commands and options that exist (the fast ones run), and its sample refusal is the one edgelin prints.

Here beside the tokenizer fixtures because the quick start's export carries a tokenizer.json and a chat template."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from edgelin.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
QUICK_START_EXPORT = "lfm2-onnx/"


def blocks(language: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def commands() -> list[list[str]]:
    """Each command line of the README's bash blocks, split as the shell would (comments and VAR=value dropped)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words = words[1:]
            if words:
                out.append(words)
    return out


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; depth belongs in docs/"
    for link, anchor in re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", README.read_text(encoding="utf-8")):
        assert (ROOT / link).is_file(), f"the README links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / link).read_text(encoding="utf-8"), flags=re.M)
            slugs = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in headings}
            assert anchor in slugs, f"the README links to {link}#{anchor}, a heading it does not have"


def test_the_python_blocks_run_as_written(chat_export, tmp_path):
    assert blocks("python"), "the README should show the Python API"
    (tmp_path / QUICK_START_EXPORT.rstrip("/")).symlink_to(chat_export, target_is_directory=True)
    for i, code in enumerate(blocks("python")):
        assert QUICK_START_EXPORT in code, f"block {i} should use the quick start's export"
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert done.returncode == 0, f"README Python block {i} failed:\n{code}\n{done.stderr[-3000:]}"
        assert done.stdout.strip(), f"README Python block {i} printed nothing"


def _options(command: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts + param.secondary_opts)
    return names


def test_every_shell_command_names_real_commands_and_options():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    seen = set()
    for words in commands():
        program, args = words[0], words[1:]
        seen.add(program)
        if program == "edgelin":
            command = main.commands.get(args[0])
            assert command is not None, f"`edgelin {args[0]}` is not a command: {' '.join(words)}"
            known = _options(command)
            for word in args[1:]:
                if word.startswith("-"):
                    assert word.split("=")[0] in known, f"`edgelin {args[0]}` has no option {word}: {' '.join(words)}"
        elif program == "make":
            for target in args:
                assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"the Makefile has no target {target}"
        elif program == "pip":
            assert args[0] == "install"
            torch = [a for a in args if a.startswith("torch==")]
            if torch:  # the same CPU build the Makefile installs
                assert f"TORCH_CPU ?= {torch[0]}" in makefile, torch[0]
        elif program == "npm":
            assert (ROOT / "package.json").is_file()
        else:
            pytest.fail(f"the README runs {program!r}, which this test does not know how to check: {' '.join(words)}")
    assert {"edgelin", "make", "pip"} <= seen


def test_the_fast_commands_run(chat_export, tmp_path, monkeypatch):
    """The quick start's generate commands, run as written on a tiny export with a chat template."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / QUICK_START_EXPORT.rstrip("/")).symlink_to(chat_export, target_is_directory=True)
    ran = 0
    for words in commands():
        if words[:2] == ["edgelin", "generate"]:
            result = CliRunner().invoke(main, words[1:])
            assert result.exit_code == 0, (words, result.output)
            ran += 1
    assert ran >= 2


def test_the_sample_refusal_is_what_edgelin_says(tmp_path):
    """The README shows the refusal of a checkpoint edgelin does not export: it must be the message edgelin prints."""
    import json

    from edgelin.errors import UnsupportedCheckpoint
    from edgelin.importers import import_checkpoint

    shown = next(line for block in blocks("text") for line in block.splitlines() if line.startswith("edgelin: error:"))
    folder_name = re.match(r"edgelin: error: ([^/]+)/config.json", shown).group(1)
    folder = tmp_path / folder_name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": re.search(r"model_type '(\w+)'", shown).group(1)}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedCheckpoint) as info:
        import_checkpoint(folder)
    assert f"edgelin: error: {info.value}".replace(str(tmp_path) + "/", "") == shown
