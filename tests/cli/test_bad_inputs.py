"""Bad inputs across the five commands and the Python API, one table.

Every CLI case must exit with status 2, print exactly one ``edgelin: error:`` line on stderr (progress
lines may precede it), print no traceback, and leave the folder tree it ran in exactly as it was (no
file changed, no folder created, no temporary folder left). Every API case must raise an
``EdgelinError`` subclass.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from edgelin.cli import main
from testkit.cli import Case
from testkit.files import tree
from edgelin.errors import EdgelinError


# ---- the world a case runs in ----------------------------------------------------------------------


# ---- ways to break things (each runs in the world before the snapshot) -----------------------------
def edit_manifest(fn: Callable[[dict], None], folder: str = "export"):
    def setup(w: Path) -> None:
        path = w / folder / "edgelin.json"
        d = json.loads(path.read_text())
        fn(d)
        path.write_text(json.dumps(d))

    return setup


def manifest_bytes(data: bytes):
    def setup(w: Path) -> None:
        (w / "export" / "edgelin.json").write_bytes(data)

    return setup


def set_state_field(field: str, value):
    def fn(d):
        d["states"][0][field] = value

    return fn


def edit_config(**changes):
    def setup(w: Path) -> None:
        path = w / "models" / "ckpt" / "config.json"
        d = json.loads(path.read_text())
        d.update(changes)
        path.write_text(json.dumps(d))

    return setup


def config_bytes(data: bytes):
    def setup(w: Path) -> None:
        (w / "models" / "ckpt" / "config.json").write_bytes(data)

    return setup


def config_fifo(w: Path) -> None:
    (w / "models" / "ckpt" / "config.json").unlink()
    os.mkfifo(w / "models" / "ckpt" / "config.json")


def config_huge(w: Path) -> None:
    with open(w / "models" / "ckpt" / "config.json", "r+b") as f:  # sparse: 17 MiB of which almost nothing is on disk
        f.truncate(17 << 20)


def nan_weights(w: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = w / "models" / "ckpt" / "model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan
    save_file(tensors, str(path), metadata={"format": "pt"})


def corrupt_weights(w: Path) -> None:
    (w / "models" / "ckpt" / "model.safetensors").write_bytes(b"\x00garbage" * 10)


def pickle_checkpoint(w: Path) -> None:
    (w / "pickled").mkdir()
    (w / "pickled" / "pytorch_model.bin").write_bytes(b"\x80\x04not really")


def symlink(name: str, target: str):
    def setup(w: Path) -> None:
        os.symlink(target, w / name)

    return setup


def extra_file_in_export(w: Path) -> None:
    (w / "export" / "notes.txt").write_text("mine\n")


def outside_graph(w: Path) -> None:
    (w / "elsewhere").mkdir()
    shutil.copy(w / "export" / "prefill.onnx", w / "elsewhere" / "prefill.onnx")
    (w / "export" / "prefill.onnx").unlink()
    os.symlink(w / "elsewhere" / "prefill.onnx", w / "export" / "prefill.onnx")


def swap_graphs(w: Path) -> None:
    e = w / "export"
    os.replace(e / "prefill.onnx", e / "tmp.onnx")
    os.replace(e / "decode.onnx", e / "prefill.onnx")
    os.replace(e / "tmp.onnx", e / "decode.onnx")


def remove_weights(w: Path) -> None:
    (w / "export" / "weights.data").unlink()


def truncate_weights(w: Path) -> None:
    path = w / "export" / "weights.data"
    os.truncate(path, path.stat().st_size - 4096)


def change_weights(w: Path) -> None:
    with open(w / "export" / "weights.data", "r+b") as f:  # one byte of the embedding, the first tensor stored
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x40]))


def state_npy(w: Path) -> None:
    np.save(w / "state.npy", np.zeros(3, np.float32))


def _session(w: Path):
    from edgelin.runtime import load

    return load(w / "export", provider="cpu")


def state_header(header) -> Callable[[Path], None]:
    def setup(w: Path) -> None:
        s = _session(w).new_state(1)
        arrays = {"__edgelin_state__": np.frombuffer(json.dumps(header).encode(), np.uint8), **s.numpy()}
        np.savez(w / "state.npz", **arrays)

    return setup


def state_nan(w: Path) -> None:
    s = _session(w)
    st = s.new_state(1)
    st.save(w / "state.npz")
    with np.load(w / "state.npz") as z:
        arrays = {k: z[k] for k in z.files}
    key = s.manifest.states[0].input
    arrays[key] = arrays[key].copy()
    arrays[key].flat[0] = np.nan
    np.savez(w / "state.npz", **arrays)


# ---- the table ---------------------------------------------------------------------------------------
CK, EX = "models/ckpt", "export"
CASES = {
    # export: the checkpoint
    "export/missing-checkpoint": Case(["export", "nope", "-o", "out"], "does not exist"),
    "export/checkpoint-is-a-file": Case(["export", "file.txt", "-o", "out"], "is not a folder"),
    "export/pickle-checkpoint": Case(["export", "pickled", "-o", "out"], "save it as safetensors where it is trusted", pickle_checkpoint),
    "export/corrupt-weights": Case(["export", CK, "-o", "out"], "not a readable safetensors file", corrupt_weights),
    "export/config-not-json": Case(["export", CK, "-o", "out"], "not valid JSON", config_bytes(b"{nope")),
    # every file read is a regular file of bounded size, checked before it is opened (a FIFO blocked the export)
    "export/config-fifo": Case(["export", CK, "-o", "out"], "is not a regular file (a FIFO, device or socket is never read)", config_fifo),
    "export/config-huge": Case(["export", CK, "-o", "out"], "more than the 16,777,216 it can be", config_huge),
    "export/budget-bound-of-another-kind": Case(["export", CK, "-o", "out", "--budget", "state.max_abs=1"], "state has no bound 'max_abs'"),
    "export/unknown-lowering": Case(["export", CK, "-o", "out", "--ops", "fast"], "'fast' is not one of 'portable', 'fused'"),
    "export/budget-not-a-number": Case(["export", CK, "-o", "out", "--budget", "logits.max_rel=tight"], "'tight' is not a number"),
    "export/config-not-utf8": Case(["export", CK, "-o", "out"], "not UTF-8", config_bytes(b'{"d_model": "\xff\xfe"}')),
    "export/config-unknown-field": Case(["export", CK, "-o", "out"], "unknown config field", edit_config(colour="red")),
    "export/config-huge-d_model": Case(["export", CK, "-o", "out"], "bytes", edit_config(d_model=10**9)),
    "export/config-disagrees-with-weights": Case(["export", CK, "-o", "out"], "weights do not match", edit_config(d_model=64)),
    "export/config-wrong-type": Case(["export", CK, "-o", "out"], "must be a positive integer", edit_config(n_layers="two")),
    "export/nan-weights": Case(["export", CK, "-o", "out"], "NaN", nan_weights),
    "export/nan-weights-no-check": Case(["export", CK, "-o", "out", "--no-check"], "NaN", nan_weights),
    # export: the output folder
    "export/out-empty-string": Case(["export", CK, "-o", ""], "current folder"),
    # a name the file system cannot hold (NAME_MAX, 255 bytes on most): refused before any work (was an OSError traceback)
    "export/out-name-too-long": Case(["export", CK, "-o", "a" * 300], "is 300 bytes, and this file system holds names of at most"),
    "export/out-name-too-long-for-the-temporary": Case(["export", CK, "-o", "a" * 250], "with room for edgelin's temporary copy"),
    "web/out-name-too-long": Case(["web", EX, "-o", "x/" + "a" * 300 + "/y"], "holds names of at most"),
    "bench/out-name-too-long": Case(["bench", CK, "--out", "a" * 300], "holds names of at most"),
    "generate/state-out-name-too-long": Case(["generate", EX, "-p", "Hi", "--state-out", "a" * 300 + ".npz"], "holds names of at most"),
    "validate/json-name-too-long": Case(["validate", EX, "--json", "a" * 300 + ".json"], "holds names of at most"),
    "export/out-dot": Case(["export", CK, "-o", "."], "current folder"),
    "export/out-dotdot": Case(["export", CK, "-o", "docs/.."], "current folder"),
    "export/out-is-checkpoint": Case(["export", CK, "-o", CK, "--force"], "checkpoint"),
    "export/out-inside-checkpoint": Case(["export", CK, "-o", f"{CK}/onnx"], "checkpoint"),
    "export/out-holds-checkpoint": Case(["export", CK, "-o", "models", "--force"], "checkpoint"),
    "export/out-exists": Case(["export", CK, "-o", EX], "already exists"),
    "export/force-user-folder": Case(["export", CK, "-o", "docs", "--force"], "not an edgelin export"),
    "export/force-export-with-user-file": Case(["export", CK, "-o", EX, "--force"], "not an edgelin export", extra_file_in_export),
    "export/out-is-a-file": Case(["export", CK, "-o", "file.txt", "--force"], "'file.txt' is a file"),
    "export/out-under-a-file": Case(["export", CK, "-o", "file.txt/sub"], "not a folder"),
    "export/trace-cache-is-a-file": Case(["export", CK, "-o", "out", "--trace-cache", "file.txt"], "trace cache file.txt is a file; give a folder"),
    "export/trace-cache-inside-out": Case(["export", CK, "-o", "out", "--trace-cache", "out/traces"], "overlaps the export's folder"),
    "export/trace-cache-is-checkpoint": Case(["export", CK, "-o", "out", "--trace-cache", CK], "overlaps the checkpoint"),
    "export/out-symlink": Case(["export", CK, "-o", "link", "--force"], "symbolic link", symlink("link", "docs")),
    "export/opset-not-a-number": Case(["export", CK, "-o", "out", "--opset", "eighteen"], "Invalid value"),
    "export/opset-out-of-range": Case(["export", CK, "-o", "out", "--opset", "7"], "opset 7"),
    "export/chunk-zero": Case(["export", CK, "-o", "out", "--chunk-size", "0"], "chunk size 0"),
    "export/max-sequence-zero": Case(["export", CK, "-o", "out", "--max-sequence", "0"], "max sequence 0 is out of range; choose 1.."),
    "export/unknown-option": Case(["export", CK, "-o", "out", "--frobnicate"], "No such option"),
    "export/missing-out": Case(["export", CK], "Missing option"),
    "cli/unknown-command": Case(["exprot"], "No such command"),
    "export/checkpoint-empty-string": Case(["export", "", "-o", "out"], "CHECKPOINT is '', an empty name"),
    "bench/section-empty": Case(["bench", "--section", ""], "--section names no section"),
    "web/port-out-of-range": Case(["web", EX, "--serve", "--port", "99999"], "99999 is not in the range 0<=x<=65535"),
    # validate
    "validate/missing-export": Case(["validate", "nope"], "is not a folder"),
    "validate/not-an-export": Case(["validate", "docs"], "no edgelin.json"),
    "validate/kv-not-lengths": Case(["validate", EX, "--kv", "1k,16k"], "--kv takes prompt lengths separated by commas"),
    "validate/kv-negative": Case(["validate", EX, "--kv", "1024,-5"], "kv length must be an integer in [1, 1,048,576]"),
    "validate/upstream-unknown-mode": Case(["validate", EX, "--checkpoint", CK, "--upstream", "sometimes"], "'sometimes' is not one of"),
    "validate/upstream-required-own-model": Case(["validate", EX, "--checkpoint", CK, "--upstream", "required"], "the checkpoint is edgelin's own model"),
    "validate/manifest-not-json": Case(["validate", EX], "not valid JSON", manifest_bytes(b"{")),
    "validate/manifest-not-utf8": Case(["validate", EX], "not UTF-8", manifest_bytes(b'{"format": "\xff"}')),
    "validate/manifest-a-list": Case(["validate", EX], "must hold a JSON object", manifest_bytes(b"[1, 2]")),
    "validate/manifest-nan-constant": Case(["validate", EX], "not valid JSON", manifest_bytes(b'{"format": NaN}')),
    "validate/manifest-too-deep": Case(["validate", EX], "nested too deeply", manifest_bytes(b"[" * 100000 + b"]" * 100000)),
    "validate/opset-string": Case(["validate", EX], "'opset' must be an integer", edit_manifest(lambda d: d.update(opset="eighteen"))),
    "validate/opset-bool": Case(["validate", EX], "'opset' must be an integer", edit_manifest(lambda d: d.update(opset=True))),
    "validate/init-string": Case(["validate", EX], "'init' must be a finite number", edit_manifest(set_state_field("init", "zero"))),
    "validate/init-infinite": Case(["validate", EX], "'init' must be a finite number", manifest_bytes(b"")),  # replaced below
    "validate/init-overflows-dtype": Case(["validate", EX], "does not fit", edit_manifest(lambda d: d["states"][0].update(dtype="float16", init=1e6))),
    "validate/states-an-object": Case(["validate", EX], "'states' must be a list", edit_manifest(lambda d: d.update(states={"a": 1}))),
    "validate/state-a-list": Case(["validate", EX], "must be an object", edit_manifest(lambda d: d["states"].__setitem__(0, [1]))),
    "validate/dtype-unknown": Case(["validate", EX], "dtype 'float64'", edit_manifest(set_state_field("dtype", "float64"))),
    "validate/dtype-not-text": Case(["validate", EX], "dtype [1]", edit_manifest(set_state_field("dtype", [1]))),
    "validate/shape-zero": Case(["validate", EX], "has shape", edit_manifest(lambda d: d["states"][0]["shape"].__setitem__(1, 0))),
    "validate/shape-float": Case(["validate", EX], "has shape", edit_manifest(lambda d: d["states"][0]["shape"].__setitem__(1, 2.5))),
    "validate/state-name-not-text": Case(["validate", EX], "'input' must be a non-empty name", edit_manifest(set_state_field("input", 7))),
    "validate/vocab-string": Case(["validate", EX], "'vocab_size'", edit_manifest(lambda d: d.update(vocab_size="256"))),
    "validate/model-a-list": Case(["validate", EX], "'model' must be an object", edit_manifest(lambda d: d.update(model=[]))),
    "validate/graph-dotdot": Case(["validate", EX], "plain file name", edit_manifest(lambda d: d["graphs"].update(prefill="../export/prefill.onnx"))),
    "validate/graph-absolute": Case(["validate", EX], "plain file name", edit_manifest(lambda d: d["graphs"].update(decode="/etc/passwd"))),
    "validate/graphs-same-file": Case(["validate", EX], "for both graphs", edit_manifest(lambda d: d["graphs"].update(decode="prefill.onnx"))),
    "validate/missing-field": Case(["validate", EX], "lacks field(s) source", edit_manifest(lambda d: d.pop("source"))),
    "validate/json-is-a-folder": Case(["validate", EX, "--json", "docs"], "is a directory"),
    "validate/json-missing-folder": Case(["validate", EX, "--json", "no/such/r.json"], "folder does not exist"),
    "validate/json-under-a-file": Case(["validate", EX, "--json", "file.txt/r.json"], "not a folder"),
    "validate/negative-seed": Case(["validate", EX, "--seed", "-1"], "seed must be an integer"),
    "validate/steps-zero": Case(["validate", EX, "--steps", "0"], "steps must be an integer"),
    "validate/long-negative": Case(["validate", EX, "--long", "-5"], "long must be an integer"),
    "validate/providers-unknown": Case(["validate", EX, "--providers", "tpu"], "providers must be"),
    "validate/checkpoint-missing": Case(["validate", EX, "--checkpoint", "nope"], "does not exist"),
    "validate/budget-no-equals": Case(["validate", EX, "--budget", "logits"], "write KIND.BOUND=VALUE"),
    "validate/budget-unknown-kind": Case(["validate", EX, "--budget", "vibes.max_rel=1e-5"], "no comparison kind 'vibes'"),
    "validate/budget-negative": Case(["validate", EX, "--budget", "logits.max_rel=-1"], "must be a finite number >= 0"),
    "validate/budget-agreement-above-one": Case(["validate", EX, "--budget", "top1.min_agreement=1.5"], "and <= 1"),
    "validate/budget-in-manifest-bad": Case(["validate", EX], "parity budget: logits has no bound 'min_agreement'",
                                            edit_manifest(lambda d: d.update(parity_budgets={"logits": {"min_agreement": 0.5}}))),
    # generate
    "generate/missing-export": Case(["generate", "nope", "-p", "Hi"], "is not a folder"),
    "generate/empty-prompt": Case(["generate", EX, "-p", ""], "prompt is empty"),
    "generate/missing-prompt": Case(["generate", EX], "no prompt given"),
    "generate/chat-without-template": Case(["generate", EX, "--chat", "-p", "Hi"], "has no chat template"),
    "generate/chat-two-prompts": Case(["generate", EX, "--chat", "-p", "Hi", "-p", "Ho"], "--chat takes one --prompt"),
    "generate/system-without-chat": Case(["generate", EX, "--system", "Be brief.", "-p", "Hi"], "--system goes with --chat"),
    "generate/negative-max-new-tokens": Case(["generate", EX, "-p", "Hi", "-n", "-1"], "max_new_tokens"),
    "generate/negative-temperature": Case(["generate", EX, "-p", "Hi", "-t", "-1"], "temperature"),
    "generate/nan-temperature": Case(["generate", EX, "-p", "Hi", "-t", "nan"], "temperature"),
    "generate/top-p-zero": Case(["generate", EX, "-p", "Hi", "--top-p", "0"], "top_p"),
    "generate/top-k-negative": Case(["generate", EX, "-p", "Hi", "--top-k", "-1"], "top_k"),
    "generate/negative-seed": Case(["generate", EX, "-p", "Hi", "--seed", "-3"], "seed"),
    "generate/empty-stop": Case(["generate", EX, "-p", "Hi", "--stop", ""], "stop"),
    "generate/negative-ngram": Case(["generate", EX, "-p", "Hi", "--no-repeat-ngram-size", "-1"], "no_repeat_ngram_size must be an integer in [0, 4096]"),
    "generate/provider-unknown": Case(["generate", EX, "-p", "Hi", "--provider", "tpu"], "provider must be"),
    "generate/threads-zero": Case(["generate", EX, "-p", "Hi", "--threads", "0"], "threads"),
    "generate/state-out-folder": Case(["generate", EX, "-p", "Hi", "--state-out", "docs"], "is a folder"),
    "generate/state-out-missing-folder": Case(["generate", EX, "-p", "Hi", "--state-out", "no/s.npz"], "folder does not exist"),
    "generate/state-in-missing": Case(["generate", EX, "-p", "Hi", "--state-in", "nope.npz", "--provider", "cpu"], "does not exist"),
    "generate/state-in-folder": Case(["generate", EX, "-p", "Hi", "--state-in", "docs", "--provider", "cpu"], "is a folder"),
    "generate/state-in-npy": Case(["generate", EX, "-p", "Hi", "--state-in", "state.npy", "--provider", "cpu"], ".npy", state_npy),
    "generate/state-in-text": Case(["generate", EX, "-p", "Hi", "--state-in", "file.txt", "--provider", "cpu"], "not an edgelin state file"),
    "generate/state-header-a-list": Case(["generate", EX, "-p", "Hi", "--state-in", "state.npz", "--provider", "cpu"], "malformed header", state_header([1, 2])),
    "generate/state-header-format": Case(["generate", EX, "-p", "Hi", "--state-in", "state.npz", "--provider", "cpu"], "state format", state_header({"format": 3})),
    "generate/state-nan": Case(["generate", EX, "-p", "Hi", "--state-in", "state.npz", "--provider", "cpu"], "NaN", state_nan),
    "generate/graphs-swapped": Case(["generate", EX, "-p", "Hi", "--provider", "cpu"], "is the decode graph", swap_graphs),
    "generate/weights-missing": Case(["generate", EX, "-p", "Hi", "--provider", "cpu"], "lacks weights.data", remove_weights),
    "generate/weights-truncated": Case(["generate", EX, "-p", "Hi", "--provider", "cpu"], "bytes but edgelin.json says", truncate_weights),
    "generate/weights-changed": Case(["generate", EX, "-p", "Hi", "--provider", "cpu"], "is not the weights file edgelin.json describes", change_weights),
    "generate/graph-symlink-outside": Case(["generate", EX, "-p", "Hi", "--provider", "cpu"], "leads outside the export folder", outside_graph),
    "generate/graph-dotdot": Case(["generate", EX, "-p", "Hi"], "plain file name", edit_manifest(lambda d: d["graphs"].update(decode="../x.onnx"))),
    "generate/init-nan": Case(["generate", EX, "-p", "Hi"], "not valid JSON", None),  # replaced below
    "generate/tokenizer-not-an-object": Case(["generate", EX, "-p", "Hi"], "'tokenizer' must be an object", edit_manifest(lambda d: d.update(tokenizer="bytes"))),
    # demo (fails before any export)
    "demo/out-user-folder": Case(["demo", "--out", "docs"], "not an edgelin export"),
    "demo/out-file": Case(["demo", "--out", "file.txt"], "'file.txt' is a file"),
    "demo/out-empty-string": Case(["demo", "--out", ""], "current folder"),
    "demo/empty-prompt": Case(["demo", "--prompt", ""], "prompt is empty"),
    "demo/bad-int": Case(["demo", "-n", "many"], "Invalid value"),
    # the sampling options are checked before the export (they were refused only after ~30 s of it)
    "demo/negative-max-new-tokens": Case(["demo", "-n", "-5"], "max_new_tokens must be an integer in [0,"),
    "demo/negative-temperature": Case(["demo", "--temperature", "-1"], "temperature must be a number in [0, 100]"),
    "demo/zero-top-p": Case(["demo", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    "demo/huge-ngram": Case(["demo", "--no-repeat-ngram-size", "99999"], "no_repeat_ngram_size must be an integer in [0, 4096]"),
    # bench (fails before any work; the default --out is in the working folder and must not appear)
    "bench/out-is-a-file": Case(["bench", CK, "--out", "file.txt"], "'file.txt' is a file"),
    "bench/out-under-a-file": Case(["bench", CK, "--out", "file.txt/x"], "not a folder"),
    "bench/threads-zero": Case(["bench", CK, "--threads", "0"], "threads"),
    "bench/unknown-section": Case(["bench", CK, "--section", "nosuch"], "nosuch"),
    "bench/negative-memory-cap": Case(["bench", CK, "--memory-cap", "-1"], "memory cap"),
    "bench/huge-memory-cap": Case(["bench", CK, "--memory-cap", "1e300"], "memory cap must be a number in (0, 1,000,000] (GB)"),
    "bench/missing-source": Case(["bench", "nope"], "nope"),
    "bench/provider-unknown": Case(["bench", CK, "--provider", "tpu"], "tpu"),
}


def _init_bytes(value: bytes):
    def setup(w: Path) -> None:
        path = w / "export" / "edgelin.json"
        text = path.read_text()
        d = json.loads(text)
        d["states"][0]["init"] = "@@INIT@@"
        path.write_bytes(json.dumps(d).encode().replace(b'"@@INIT@@"', value))

    return setup


CASES["validate/init-infinite"] = Case(["validate", EX], "'init' must be a finite number", _init_bytes(b"1e400"))
CASES["generate/init-nan"] = Case(["generate", EX, "-p", "Hi"], "not valid JSON", _init_bytes(b"NaN"))
# an empty EXPORT_DIR was read as '.', the current folder ("'.' is not an edgelin export")
for _cmd, _rest in (("validate", []), ("generate", ["-p", "Hi"]), ("check", []), ("web", ["-o", "site"])):
    CASES[f"{_cmd}/empty-export-name"] = Case([_cmd, "", *_rest], "EXPORT_DIR is '', an empty name")


@pytest.mark.parametrize("name", [pytest.param(k, id=k) for k in CASES])
def test_bad_input_is_one_line_and_changes_nothing(world, name):
    case = CASES[name]
    if case.setup is not None:
        case.setup(world)
    before = tree(world)
    result = CliRunner().invoke(main, case.args)
    text = result.output + result.stderr
    assert "Traceback" not in text, text
    assert isinstance(result.exception, SystemExit) or result.exception is None, repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("edgelin: error:")]
    assert len(errors) == 1, result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith(("Usage:", "Try ", "Error:"))], result.stderr
    assert case.expect in errors[0], errors[0]
    assert tree(world) == before


def test_edgelin_alone_prints_its_help():
    result = CliRunner().invoke(main, [], prog_name="edgelin")
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr
    assert result.stderr.startswith("Usage: edgelin [OPTIONS] COMMAND [ARGS]...") and "\nCommands:\n" in result.stderr
    assert "edgelin: error:" not in result.stderr and len(result.stderr.splitlines()) > 10


@pytest.mark.parametrize("where, redirect", [
    ("closed", ">&-"),  # fd 1 closed at start
    ("full", ">/dev/full"),  # every write fails with ENOSPC
    ("gone", "| head -c 0"),  # the reader exits at once: EPIPE
])
@pytest.mark.parametrize("args", [["--version"], ["export", "--help"], ["generate", "{export}", "-p", "x", "-n", "400"]])
def test_standard_output_that_cannot_be_written_is_one_line(exported, tmp_path, where, redirect, args):
    """Standard output closed, on a full disk, or read by a program that went away: one line, exit 2, never a
    traceback (generate wrote through sys.stdout: AttributeError / OSError tracebacks before)."""
    import shlex
    import subprocess
    import sys

    if where == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    words = [a.format(export=exported("elu+1")[1]) for a in args]
    edgelin = [sys.executable, "-c", "from edgelin.cli import main; main()"]
    line = " ".join(shlex.quote(w) for w in edgelin + words)
    err = tmp_path / "stderr.txt"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", f"{line} 2>{shlex.quote(str(err))} {redirect}"], timeout=300)
    said = err.read_text()
    if where == "gone" and proc.returncode == 0:  # the pipe took everything before the reader closed it
        assert said == "" or "Traceback" not in said
        return
    assert proc.returncode == 2 and "Traceback" not in said and "Exception ignored" not in said, said
    lines = [ln for ln in said.splitlines() if ln.startswith("edgelin: error:")]
    assert len(lines) == 1 and "standard output" in lines[0], said


def test_a_deleted_current_folder_is_one_line(exported, tmp_path):
    """Run from a folder deleted under the shell (web --serve ended in a FileNotFoundError traceback): one line,
    exit 2, nothing written."""
    import shlex
    import subprocess
    import sys

    export = exported("elu+1")[1]
    line = " ".join(shlex.quote(w) for w in [sys.executable, "-c", "from edgelin.cli import main; main()", "web", str(export), "-o", "site"])
    proc = subprocess.run(["bash", "-c", f"mkdir gone && cd gone && rmdir ../gone && {line}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("edgelin: error: the current folder cannot be read") and len(proc.stderr.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_web_serve_on_a_busy_port_writes_nothing(exported, tmp_path):
    """The port is tried before the site is written (the site was written, then the bind failed)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(main, ["web", str(exported("elu+1")[1]), "--serve", "--port", str(port), "-o", str(tmp_path / "site")],
                                    prog_name="edgelin")
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr
    assert result.stderr.strip() == f"edgelin: error: cannot serve on 127.0.0.1:{port}: Address already in use; choose another --port"
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_the_table_is_large_enough():
    assert len(CASES) >= 60
    assert {k.split("/")[0] for k in CASES} >= {"export", "validate", "generate", "demo", "bench"}


# ---- the Python API: only EdgelinError subclasses escape ---------------------------------------------
def _api_cases():
    from edgelin.errors import CheckpointError, ManifestError, NonFiniteError, OutputError, RuntimeInputError

    def manifest_list(w):
        from edgelin.runtime import Manifest

        Manifest.from_json("[]")

    def manifest_bytes_api(w):
        from edgelin.runtime.manifest import parse_json

        parse_json(b"\xff\xfe")

    def huge_batch(w):
        _session(w).new_state(10**9)

    def float_ids(w):
        s = _session(w)
        s.prefill(np.array([[0.5, 1.5]]), s.new_state(1))

    def zero_d_state(w):
        from edgelin.runtime import State

        s = _session(w)
        State.from_arrays(s.manifest, {spec.input: np.float32(0) for spec in s.manifest.states})

    def lone_surrogate(w):
        from edgelin.runtime import ByteTokenizer

        ByteTokenizer().encode("a\ud800b")

    def huge_config(w):
        from edgelin.checkpoint import load_checkpoint

        edit_config(d_model=10**9)(w)
        load_checkpoint(w / "models" / "ckpt")

    def nan_export(w):
        from edgelin.checkpoint import load_checkpoint
        from edgelin.exporters import export

        nan_weights(w)
        export(load_checkpoint(w / "models" / "ckpt"), w / "out", check=False)

    def nan_generation(w):
        from edgelin.runtime import Generator, State

        s = _session(w)
        arrays = s.new_state(1).numpy()
        key = s.manifest.states[0].input
        arrays[key][...] = np.nan
        list(Generator(s, "Hi", state=State.from_arrays(s.manifest, arrays), max_new_tokens=4))

    def negative_seed(w):
        from edgelin.validate import validate

        validate(w / "export", w / "models" / "ckpt", seed=-1)

    def state_save_into_folder(w):
        _session(w).new_state(1).save(w / "docs")

    def force_user_folder(w):
        from edgelin.exporters import export

        export(w / "models" / "ckpt", w / "docs", force=True)

    def stack_nothing(w):
        from edgelin.runtime import State

        State.stack([])

    def rows_out_of_range(w):
        _session(w).new_state(1).rows([5])

    def rows_none(w):
        _session(w).new_state(2).rows([])

    def ragged_nested_ids(w):
        s = _session(w)
        s.prefill([[1, 2], [3]], s.new_state(2))

    return {
        "state-stack-nothing": (stack_nothing, RuntimeInputError),
        "state-rows-out-of-range": (rows_out_of_range, RuntimeInputError),
        "state-rows-empty": (rows_none, RuntimeInputError),
        "ragged-nested-token-ids": (ragged_nested_ids, RuntimeInputError),
        "manifest-a-list": (manifest_list, ManifestError),
        "manifest-bytes-not-utf8": (manifest_bytes_api, ManifestError),
        "state-batch-1e9": (huge_batch, RuntimeInputError),
        "float-token-ids": (float_ids, RuntimeInputError),
        "zero-d-state-array": (zero_d_state, RuntimeInputError),
        "lone-surrogate-prompt": (lone_surrogate, RuntimeInputError),
        "config-1e9-d_model": (huge_config, CheckpointError),
        "nan-weights-export": (nan_export, NonFiniteError),
        "nan-logits-generation": (nan_generation, NonFiniteError),
        "validate-negative-seed": (negative_seed, EdgelinError),
        "state-save-into-a-folder": (state_save_into_folder, OutputError),
        "export-force-user-folder": (force_user_folder, OutputError),
    }


API_NAMES = [
    "manifest-a-list", "manifest-bytes-not-utf8", "state-batch-1e9", "float-token-ids", "zero-d-state-array",
    "lone-surrogate-prompt", "config-1e9-d_model", "nan-weights-export", "nan-logits-generation",
    "validate-negative-seed", "state-save-into-a-folder", "export-force-user-folder",
    "state-stack-nothing", "state-rows-out-of-range", "state-rows-empty", "ragged-nested-token-ids",
]


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in API_NAMES])
def test_api_raises_only_edgelin_errors(world, name):
    fn, kind = _api_cases()[name]
    before = tree(world)
    with pytest.raises(EdgelinError) as info:
        fn(world)
    assert isinstance(info.value, kind), repr(info.value)
    assert "\n" not in str(info.value)
    if name not in ("config-1e9-d_model", "nan-weights-export"):  # those edit the world on purpose
        assert tree(world) == before


def test_messages_name_the_step_and_the_bytes(world):
    from edgelin.runtime import Generator, State

    s = _session(world)
    with pytest.raises(EdgelinError, match=r"needs [\d,]+ bytes"):
        s.new_state(10**9)
    arrays = s.new_state(1).numpy()
    arrays[s.manifest.states[0].input][...] = np.nan
    with pytest.raises(EdgelinError, match="after the prompt"):
        list(Generator(s, "Hi", state=State.from_arrays(s.manifest, arrays), max_new_tokens=4))
