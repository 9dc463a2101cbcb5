"""A checkpoint's Hugging Face tokenizer through export: copied with its sha256 into the manifest (kind
'huggingface'), special ids read from the checkpoint in Hugging Face's order, refused by name where it does not
fit the model, and read back by the runtime (text in, text out, every eos id stopping)."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from edgelin.errors import ExportError, ManifestError
from edgelin.exporters.tokenizer import find_tokenizer, hf_tokenizer_entry
from edgelin.runtime import Generator, load
from edgelin.runtime.manifest import MANIFEST_FILE, Manifest, file_sha256
from edgelin.runtime.schema import schema

VOCAB = 512


def manifest_tokenizer(export_dir):
    return json.loads((export_dir / MANIFEST_FILE).read_text())["tokenizer"]


def reference(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_export_picks_up_the_checkpoints_tokenizer_and_describes_it(hf_export, hf_checkpoint):
    out = hf_export("bytelevel")
    tok = manifest_tokenizer(out)
    assert tok == {
        "kind": "huggingface", "encoding": None, "offset": 0,
        "bos_id": 0, "eos_id": 0, "eos_ids": [0, 1], "pad_id": None,  # generation_config.json's eos list, its bos
        "add_bos": False, "skip_special_tokens": True,
        "files": {name: file_sha256(hf_checkpoint / name) for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")},
    }
    for name, digest in tok["files"].items():
        assert file_sha256(out / name) == digest
    # the graphs' embedded copy says the same; the manifest follows the schema (jsonschema, the reference validator)
    import onnx

    meta = {p.key: p.value for p in onnx.load(str(out / "decode.onnx"), load_external_data=False).metadata_props}
    assert json.loads(meta["edgelin"])["tokenizer"] == tok
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads((out / MANIFEST_FILE).read_text()), schema())


@pytest.mark.parametrize("kind, want", [
    ("sentencepiece", {"bos_id": 1, "eos_id": 2, "eos_ids": [2], "pad_id": 0, "add_bos": True}),  # post-processor adds <s>
    ("ascii", {"bos_id": None, "eos_id": 1, "eos_ids": [1], "pad_id": None, "add_bos": False}),  # tokenizer_config says no bos
])
def test_special_ids_from_the_tokenizer_files(hf_tokenizer, kind, want):
    entry = hf_tokenizer_entry(hf_tokenizer(kind) / "tokenizer.json", VOCAB)
    assert {k: entry.spec[k] for k in want} == want


def test_special_ids_generation_config_then_config_then_tokenizer_config(hf_tokenizer, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(hf_tokenizer("sentencepiece"), ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gla", "bos_token_id": 5, "eos_token_id": 6, "pad_token_id": 7}))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9, 8]}))
    entry = hf_tokenizer_entry(ckpt / "tokenizer.json", VOCAB, ckpt)
    assert (entry.spec["bos_id"], entry.spec["eos_id"], entry.spec["eos_ids"], entry.spec["pad_id"]) == (5, 8, [8, 9], 7)
    assert entry.sources["eos_id"] == "generation_config.json eos_token_id"
    assert entry.sources["bos_id"] == "config.json bos_token_id"
    assert set(entry.files) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}


def test_a_tokenizer_larger_than_the_model_is_refused_by_name(hf_tokenizer):
    folder = hf_tokenizer("bytelevel")
    top = reference(folder).get_vocab_size(with_added_tokens=True) - 1
    with pytest.raises(ExportError, match=rf"token '.+' has id {top}, outside the model's vocabulary of 300; .*--tokenizer PATH"):
        hf_tokenizer_entry(folder / "tokenizer.json", 300)


def test_a_special_id_beyond_the_vocabulary_is_refused(hf_tokenizer, tmp_path):
    shutil.copytree(hf_tokenizer("ascii"), tmp_path / "t")
    (tmp_path / "t" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 600]}))
    with pytest.raises(ExportError, match=r"generation_config.json eos_token_id: eos id 600 is outside the model's vocabulary of 512"):
        hf_tokenizer_entry(tmp_path / "t" / "tokenizer.json", VOCAB)


def test_find_tokenizer(hf_tokenizer, tmp_path):
    folder = hf_tokenizer("ascii")
    assert find_tokenizer(None, folder) == folder / "tokenizer.json"
    assert find_tokenizer(None, folder / "tokenizer.json") == folder / "tokenizer.json"
    assert find_tokenizer(folder, None) == folder / "tokenizer.json"
    assert find_tokenizer(tmp_path, None) is None
    with pytest.raises(ExportError, match="holds no tokenizer.json; pass the checkpoint's tokenizer with --tokenizer PATH"):
        find_tokenizer(None, tmp_path)
    with pytest.raises(ExportError, match="does not exist"):
        find_tokenizer(None, tmp_path / "missing")


def export_cli(*args):
    from edgelin.cli import main

    return CliRunner().invoke(main, ["export", *map(str, args)])


@pytest.mark.parametrize("bad", ["not json", '{"model": 3}', ""], ids=["text", "not-a-tokenizer", "empty"])
def test_cli_a_tokenizer_json_that_does_not_parse_is_one_line_exit_2(hf_checkpoint, tmp_path, bad):
    (tmp_path / "tokenizer.json").write_text(bad)
    r = export_cli(hf_checkpoint, "-o", tmp_path / "out", "--tokenizer", tmp_path / "tokenizer.json", "--no-check")
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("edgelin: error: ") and "is not a tokenizer.json the `tokenizers` package can read" in lines[-1]
    assert "--tokenizer PATH" in lines[-1] and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_cli_a_tokenizer_too_large_and_a_missing_path_are_one_line_exit_2(tiny_checkpoint, tmp_path, hf_tokenizer):
    small = tiny_checkpoint(300)
    r = export_cli(small, "-o", tmp_path / "out", "--tokenizer", hf_tokenizer("bytelevel"), "--no-check")
    errors = [line for line in r.stderr.splitlines() if line.startswith("edgelin: error: ")]  # after the progress lines
    assert r.exit_code == 2 and len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.output
    assert "outside the model's vocabulary of 300" in errors[0] and "Traceback" not in r.output
    r = export_cli(small, "-o", tmp_path / "out", "--tokenizer", tmp_path / "nowhere", "--no-check")
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        f"edgelin: error: tokenizer {tmp_path / 'nowhere'} does not exist; pass the checkpoint's tokenizer with --tokenizer PATH "
        "(a folder holding tokenizer.json, or the file)"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["dangling-link", "fifo"])
def test_a_checkpoint_tokenizer_that_is_not_a_file_is_refused_not_passed_over(tiny_checkpoint, tmp_path, kind):
    """A checkpoint whose tokenizer.json is a dangling link (a copied hub snapshot) or a FIFO: refused by name, exit 2,
    never exported with the byte tokenizer in its place."""
    import os
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(300), ckpt)
    if kind == "fifo":
        os.mkfifo(ckpt / "tokenizer.json")
    else:
        os.symlink("../blobs/abc", ckpt / "tokenizer.json")
    r = export_cli(ckpt, "-o", tmp_path / "out", "--no-check")
    want = "does not exist" if kind == "dangling-link" else "is not a regular file"
    assert r.exit_code == 2 and "the checkpoint's tokenizer" in r.stderr and want in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()
    # named with --tokenizer (the file, or a folder holding it): the same, not "does not exist" / "holds no"
    for given in (ckpt / "tokenizer.json", ckpt):
        r = export_cli(tiny_checkpoint(300), "-o", tmp_path / "out", "--tokenizer", given, "--no-check")
        assert r.exit_code == 2 and want in r.stderr and "holds no" not in r.stderr, r.output


# ---- the runtime reads it ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece", "ascii"])
def test_generated_text_is_the_tokenizers_decoding_of_the_generated_ids(hf_export, hf_tokenizer, kind):
    ref = reference(hf_tokenizer(kind))
    session = load(hf_export(kind), provider="cpu")
    prompt = "class Stack: 漢字 😀 e\u0301"
    gen = Generator(session, prompt, max_new_tokens=40, eos_id=[], temperature=1.0, seed=0)
    pieces = [t.text for t in gen]
    spec = manifest_tokenizer(hf_export(kind))
    want_prompt = ref.encode(prompt).ids if spec["add_bos"] else ref.encode(prompt, add_special_tokens=False).ids
    assert gen.prompt_ids[0].tolist() == want_prompt
    assert "".join(pieces) == gen.text == ref.decode(gen.results[0].ids)
    assert len(gen.results[0].ids) == 40


def test_every_eos_id_stops(hf_export):
    session = load(hf_export("bytelevel"), provider="cpu")
    free = Generator(session, "Hello", max_new_tokens=30, eos_id=[]).run().results[0].ids
    for stop_at in (0, 1):  # the manifest's eos_ids [0, 1]: put either at a position greedy decoding reaches
        target = free[5]
        gen = Generator(session, "Hello", max_new_tokens=30, eos_id=[stop_at, target]).run()
        assert gen.results[0].stop_reason == "eos" and gen.results[0].ids == free[: free.index(target)]
    assert Generator(session, "Hello", max_new_tokens=30).eos_ids == frozenset({0, 1})


def test_a_missing_or_changed_tokenizer_file_is_refused(hf_export, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(hf_export("bytelevel"), out)
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace("<|end|>", "<|END|>"))
    with pytest.raises(ManifestError, match="tokenizer.json is not the file edgelin.json describes"):
        load(out, provider="cpu").tokenizer
    (out / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match="lacks tokenizer.json, the tokenizer named in edgelin.json"):
        load(out, provider="cpu").tokenizer


def test_manifest_reader_checks_the_huggingface_entry(hf_export):
    data = json.loads((hf_export("bytelevel") / MANIFEST_FILE).read_text())
    for key in ("files", "add_bos", "eos_ids"):
        broken = json.loads(json.dumps(data))
        del broken["tokenizer"][key]
        with pytest.raises(ManifestError, match=f"a 'huggingface' tokenizer needs {key}"):
            Manifest.from_dict(broken)
    broken = json.loads(json.dumps(data))
    broken["tokenizer"]["eos_ids"] = [1, 0]
    with pytest.raises(ManifestError, match="must begin with eos_id 0"):
        Manifest.from_dict(broken)
    broken["tokenizer"]["eos_ids"] = [0, 512]
    with pytest.raises(ManifestError, match="eos_ids holds 512, outside the vocabulary"):
        Manifest.from_dict(broken)
    broken = json.loads(json.dumps(data))
    broken["tokenizer"]["files"]["vocab.txt"] = "0" * 64
    with pytest.raises(ManifestError, match="unknown field"):
        Manifest.from_dict(broken)


def generate_cli(*args):
    from edgelin.cli import main

    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_cli_generates_text_with_the_tokenizer(hf_export, hf_tokenizer):
    out = hf_export("sentencepiece")
    r = generate_cli(out, "-p", "Hello world", "-n", "12", "--provider", "cpu", "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["text"] == reference(hf_tokenizer("sentencepiece")).decode(got["ids"]) and got["has_text"]
    assert got["prompt_tokens"] == len(reference(hf_tokenizer("sentencepiece")).encode("Hello world").ids)  # <s> included
