"""`edgelin validate`: a correct export passes everything; tampered exports are caught and located."""

from __future__ import annotations

import json

from edgelin.runtime.manifest import sync_io
import shutil

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from edgelin.checkpoint import save_checkpoint
from edgelin.cli import main
from edgelin.config import FEATURE_MAPS, ModelConfig
from edgelin.exporters import export
from edgelin.model import LinearLM
from edgelin.parity import BUDGETS
from edgelin.validate import validate


def tiny(feature_map: str, seed: int = 0) -> LinearLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16, feature_map=feature_map,
        normalisation="none" if feature_map == "identity" else "denominator",
    )
    return LinearLM(cfg).eval()


def checkpoint_and_export(export_cache, export_of, feature_map: str, seed: int):
    """(checkpoint folder, export folder) of ``tiny(feature_map, seed)``, each made once per run (shared)."""
    recipe = {"validate_tiny": feature_map, "seed": seed}
    ckpt = export_cache.get(f"validate-ckpt-{feature_map.replace('+', 'p')}", recipe, lambda folder: save_checkpoint(tiny(feature_map, seed), folder))
    return ckpt, export_of(ckpt, recipe, label=f"validate-{feature_map.replace('+', 'p')}", check=False)


@pytest.fixture(scope="module")
def base(export_cache, export_of):
    """(checkpoint folder, export folder) of an elu+1 model; tests copy the export before breaking it."""
    return checkpoint_and_export(export_cache, export_of, "elu+1", 0)


@pytest.fixture
def broken(base, tmp_path):
    dst = tmp_path / "export"
    shutil.copytree(base[1], dst)
    return dst


def failed(report):
    return {f"{c.group}/{c.name}": c.where for c in report.checks if c.status == "fail"}


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_correct_export_passes_every_check(feature_map, export_cache, export_of):
    ckpt, out = checkpoint_and_export(export_cache, export_of, feature_map, 1)
    report = validate(out, ckpt, steps=24, long=300)
    assert report.passed, report.table()
    groups = {c.group for c in report.checks}
    assert groups == {"structure", "prefill", "decode", "graphs", "golden", "long", "behaviour", "precision"}
    assert all(c.status == "pass" for c in report.checks)
    assert report.drift and report.drift[-1]["step"] == 300


@pytest.mark.parametrize("prepack", [True, False], ids=["prepack", "no-prepack"])
def test_decode_weight_changed_by_1e_3(base, broken, prepack):
    """Caught with the session's weights packed (the runtime's default) and read in place (--no-prepack)."""
    ckpt, _ = base
    model = tiny("elu+1")
    target = model.blocks[1].attn.v_proj.weight.detach().numpy().T  # the exporter stores x @ W^T as W^T
    proto = onnx.load(str(broken / "decode.onnx"))
    hits = [t for t in proto.graph.initializer if tuple(t.dims) == target.shape and np.array_equal(onnx.numpy_helper.to_array(t), target)]
    assert len(hits) == 1
    arr = onnx.numpy_helper.to_array(hits[0]).copy()
    arr[3, 5] += 1e-3
    hits[0].CopyFrom(onnx.numpy_helper.from_array(arr, hits[0].name))
    onnx.save(proto, str(broken / "decode.onnx"))

    report = validate(broken, ckpt, steps=8, prepack=prepack)
    fails = failed(report)
    assert not report.passed and report.prepack is prepack
    assert "decode/8 steps, state fed back" in fails
    assert "first diverging step 0: layer 1, state S (present.1.S)" in fails["decode/8 steps, state fed back"]
    assert not any(k.startswith("prefill/") for k in fails)  # the prefill graph is intact
    assert [k for k in fails if k.startswith("golden/")] == ["golden/decode vs golden (8 steps)"]  # so does the runtime check
    assert any(k.startswith("graphs/") for k in fails)  # prefill and decode now disagree
    assert "decode.onnx is not the file edgelin.json describes" in fails["structure/graph files <-> edgelin.json sha256"]


def test_the_checkpoint_is_mapped_from_a_scratch_folder_beside_the_export(base, tmp_path, monkeypatch):
    """validate reads the checkpoint one tensor at a time into a scratch folder beside the export (said), removed when
    it ends; where none can be made there, the weights are loaded into memory, said, and the checks are the same."""
    ckpt, out = base
    export = tmp_path / "beside" / "export"
    shutil.copytree(out, export)
    said: list[str] = []
    report = validate(export, ckpt, steps=4, kv=(), heldout_bytes=514, progress=said.append)
    assert report.passed, report.table()
    assert any("into a scratch file in" in m and str(tmp_path / "beside") in m for m in said), said
    assert [p.name for p in (tmp_path / "beside").iterdir()] == ["export"]  # the scratch folder is gone

    def no_folder(*_args, **_kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr("edgelin.validate.run.tempfile.TemporaryDirectory", no_folder)
    said.clear()
    again = validate(export, ckpt, steps=4, kv=(), heldout_bytes=514, progress=said.append)
    assert any(m.startswith("no scratch folder beside the export (read-only)") for m in said), said
    assert [(c.group, c.name, c.status) for c in again.checks] == [(c.group, c.name, c.status) for c in report.checks]


def test_the_golden_group_is_held_to_the_runs_budget(base):
    ckpt, out = base
    report = validate(out, ckpt, steps=4, budget={"logits": {"max_rel": 1e-12}})
    golden_checks = [c for c in report.checks if c.group == "golden"]
    assert len(golden_checks) == 2 and all(c.status == "fail" and c.budget["max_rel"] == 1e-12 for c in golden_checks)


def test_state_output_wired_to_the_wrong_layer(base, broken):
    ckpt, _ = base
    # what a buggy exporter would write: layer 1's new S leaves the graph as present.0.S and vice versa
    proto = onnx.load(str(broken / "decode.onnx"))
    internal = {"present.0.S": "s0_internal", "present.1.S": "s1_internal"}
    for node in proto.graph.node:
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                names[i] = internal.get(name, name)
    proto.graph.node.extend([
        onnx.helper.make_node("Identity", ["s1_internal"], ["present.0.S"]),
        onnx.helper.make_node("Identity", ["s0_internal"], ["present.1.S"]),
    ])
    onnx.save(proto, str(broken / "decode.onnx"))

    report = validate(broken, ckpt, steps=8)
    fails = failed(report)
    assert "layer 0, state S (present.0.S)" in fails["decode/8 steps, state fed back"]
    assert "first diverging step 0" in fails["decode/8 steps, state fed back"]


def test_graphs_from_different_checkpoints(base, broken, tmp_path):
    ckpt, _ = base
    export(tiny("elu+1", seed=7), tmp_path / "other", check=False)
    shutil.copy(tmp_path / "other" / "decode.onnx", broken / "decode.onnx")

    report = validate(broken, ckpt, steps=8)
    fails = failed(report)
    assert "metadata differs from edgelin.json" in fails["structure/decode graph <-> manifest"]
    assert "structure/prefill graph <-> manifest" not in fails
    # the runtime itself refuses such a pair, so no numbers are compared
    assert "decode.onnx was exported from another model" in fails["structure/runtime can load the export"]


@pytest.mark.parametrize("change, needle", [
    ({"vocab_size": 300}, "vocabulary of 300, the export 256"),
    ({"n_layers": 3}, "state state.2.S (checkpoint: ['batch', 2, 16, 16]; export: none)"),
    ({"head_dim": 8}, "state state.0.S (checkpoint: ['batch', 2, 8, 8]; export: ['batch', 2, 16, 16])"),
])
def test_the_checkpoint_of_another_model_fails_without_comparing(base, tmp_path, change, needle):
    """Another model's checkpoint (was a KeyError traceback): the structure group says why, nothing is compared."""
    torch.manual_seed(0)
    cfg = ModelConfig(**{**tiny("elu+1").cfg.to_dict(), **change})
    ckpt = save_checkpoint(LinearLM(cfg).eval(), tmp_path / "other")
    report = validate(base[1], ckpt, steps=4)
    fails = failed(report)
    assert not report.passed and needle in fails["structure/checkpoint's model <-> export"], fails
    assert {c.group for c in report.checks} == {"structure"}


def test_manifest_with_an_edited_state_shape(base, broken):
    ckpt, _ = base
    manifest = json.loads((broken / "edgelin.json").read_text())
    manifest["states"][0]["shape"][-1] = 8
    (broken / "edgelin.json").write_text(json.dumps(sync_io(manifest)))

    report = validate(broken, ckpt, steps=8)
    fails = failed(report)
    assert not report.passed
    for graph in ("prefill", "decode"):
        assert "input 'state.0.S' has shape ['batch', 2, 16, 16], the manifest says ['batch', 2, 16, 8]" in fails[f"structure/{graph} graph <-> manifest"]
    assert "structure/runtime can load the export" in fails


def test_wrong_checkpoint_is_named(base, tmp_path):
    _, out = base
    other = save_checkpoint(tiny("elu+1", seed=3), tmp_path / "other")
    report = validate(out, other, steps=4)
    assert "weights sha256" in failed(report)["structure/source weights + config"]


def test_cli_exit_codes_and_json(base, tmp_path):
    ckpt, out = base
    runner = CliRunner()
    ok = runner.invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--json", str(tmp_path / "r.json")])
    assert ok.exit_code == 0, ok.output
    assert "PASS: " in ok.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] is True and report["budgets"] == BUDGETS["fp32"] and report["prepack"] is True
    unpacked = runner.invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--no-prepack", "--json",
                                    str(tmp_path / "r2.json")])
    assert unpacked.exit_code == 0 and "read the weights in place (--no-prepack)" in unpacked.stdout, unpacked.output
    assert json.loads((tmp_path / "r2.json").read_text())["prepack"] is False

    cuda = runner.invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--providers", "cpu,cuda"])
    if cuda.exit_code == 0:  # a machine with a working GPU
        assert "cuda vs cpu" in cuda.stdout and "pass" in cuda.stdout
    else:
        assert cuda.exit_code == 1 and "not available" in cuda.stdout
        auto = runner.invoke(main, ["validate", str(out), "--checkpoint", str(ckpt), "--steps", "4", "--providers", "auto"])
        assert auto.exit_code == 0 and "n/a" in auto.stdout

    for args, message in (
        ([str(tmp_path / "nothing")], "not a folder"),
        ([str(out), "--checkpoint", str(ckpt), "--steps", "0"], "steps must be an integer"),
        ([str(out), "--checkpoint", str(ckpt), "--providers", "tpu"], "providers must be"),
        ([str(out)], "pass --checkpoint"),
    ):
        bad = runner.invoke(main, ["validate", *args])
        assert bad.exit_code == 2, (args, bad.output)
        assert bad.stderr.strip().splitlines()[-1].startswith("edgelin: error:") and message in bad.stderr


def test_a_check_not_available_is_not_blamed_on_a_provider():
    """A model without a byte tokenizer has no held-out text check ("n/a"): the verdict line must not say a
    provider is missing when every provider asked for is active; it must when one is not."""
    from edgelin.validate import NA, PASS, Check, Report

    checks = [Check("prefill", "T=1 batch=1", PASS), Check("precision", "held-out text: bits/byte delta", NA, where="needs bytes")]
    ok = Report("out", "ckpt", "fp32", {"cpu": "active"}, checks=list(checks))
    assert ok.passed and ok.table().splitlines()[-1].startswith("PASS") and "provider" not in ok.table().splitlines()[-1]
    missing = Report("out", "ckpt", "fp32", {"cpu": "active", "cuda": "not available: no CUDA"}, checks=list(checks))
    assert not missing.passed and "a provider named in --providers is not available" in missing.table().splitlines()[-1]


def test_held_out_text_as_a_hugging_face_tokenizer_reads_it():
    """text_tokens: a byte-level BPE's ids for the text and, per token, the byte where it ends (characters of 2-4
    UTF-8 bytes included), so held-out bits/byte divides by the bytes the predicted tokens cover; a byte tokenizer:
    one token per byte, shifted by its offset."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from edgelin.runtime.tokenizer import HuggingFaceTokenizer
    from edgelin.validate import text_tokens

    text = "déjà vu: 𝛑 ≈ 3.14 — def f(x):\n    return x * 2  # ünïcode\n" * 3
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    session = SimpleNamespace(manifest=SimpleNamespace(tokenizer={"kind": "huggingface"}), tokenizer=HuggingFaceTokenizer(tok, vocab_size=300))
    data = text.encode()
    ids, ends = text_tokens(session, data)
    assert tok.decode(ids.tolist()) == text and 1 < len(ids) < len(data)
    assert ends[-1] == len(data) and np.all(np.diff(ends) >= 0)
    for k in (0, 5, len(ids) // 2):  # the bytes up to a token's end decode to the tokens up to it
        assert tok.decode(ids[: k + 1].tolist()).encode() == data[: ends[k]]
    ids, ends = text_tokens(session, data[:2])  # "d" + the first byte of "é": the incomplete character dropped
    assert tok.decode(ids.tolist()) == "d" and ends.tolist() == [1]

    byte_session = SimpleNamespace(manifest=SimpleNamespace(tokenizer={"kind": "bytes", "offset": 3}))
    ids, ends = text_tokens(byte_session, b"ab\xc3")
    assert ids.tolist() == [100, 101, 198] and ends.tolist() == [1, 2, 3]
