"""The export as files: a manifest-only driver, determinism, atomicity, refusal to overwrite."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from edgelin.errors import CheckpointError, ExportError, OutputError
import edgelin.exporters.exporter as export_impl
import edgelin.exporters.tracing as tracing
from edgelin.exporters import export
from edgelin.parity import Errors
from edgelin.runtime.manifest import Manifest

# A driver that knows only the contract: json + numpy + onnxruntime, with torch and edgelin unimportable.
MANIFEST_ONLY_DRIVER = textwrap.dedent(
    """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "edgelin"):
                raise ImportError(f"{name} is blocked in this test")
    sys.meta_path.insert(0, Block())
    import json, pathlib
    import numpy as np
    import onnxruntime as ort

    out = pathlib.Path(sys.argv[1])
    prompt = json.loads(sys.argv[2])
    m = json.loads((out / "edgelin.json").read_text())
    assert m["format"] == "edgelin/2"
    sess = {g: ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"]) for g, f in m["graphs"].items()}
    dtypes = {"float32": np.float32, "float16": np.float16, "int64": np.int64}
    state = {s["input"]: np.full([1 if d == "batch" else d for d in s["shape"]], s["init"], dtypes[s["dtype"]]) for s in m["states"]}

    def run(graph, ids, state):
        # the prefill graph returns the logits of the positions its logits_at input names (the manifest says which)
        at = {m["logits_at"]: np.array([[len(ids) - 1]], np.int64)} if graph == "prefill" and "logits_at" in m else {}
        outs = sess[graph].run([m["logits"]] + [s["output"] for s in m["states"]],
                               {m["input_ids"]: np.array([ids], np.int64), **at, **state})
        return outs[0], {s["input"]: v for s, v in zip(m["states"], outs[1:])}

    logits, state = run("prefill", prompt, state)
    tokens = []
    for _ in range(8):
        tok = int(logits[0, -1].argmax())
        tokens.append(tok)
        logits, state = run("decode", [tok], state)
    print(json.dumps(tokens))
    """
)


def test_manifest_alone_drives_both_graphs(exported):
    model, out = exported("cosformer")
    prompt = [int(x) for x in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))]
    proc = subprocess.run([sys.executable, "-c", MANIFEST_ONLY_DRIVER, str(out), json.dumps(prompt)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    # greedy continuation in PyTorch
    ids = torch.tensor([prompt])
    want = []
    with torch.no_grad():
        logits, state = model(ids)
        for _ in range(8):
            tok = int(logits[0, -1].argmax())
            want.append(tok)
            logits, state = model.step(torch.tensor([[tok]]), state)
    assert got == want


def test_reexport_is_byte_identical(exported, tmp_path):
    from edgelin.checkpoint import save_checkpoint, weights_sha256

    model, in_memory = exported("performer")  # the shared export, made from the model object itself
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    a = export(ckpt, tmp_path / "a", chunk_size=8, check=False)
    b = export(ckpt, tmp_path / "b", chunk_size=8, check=False, trace_cache=tmp_path / "traces")  # traced, and kept
    said = []
    export(ckpt, tmp_path / "c", chunk_size=8, check=False, trace_cache=tmp_path / "traces", progress=said.append)
    assert sum("taken from the trace cache" in s for s in said) == 2, said  # not traced: from the cache
    for name in ("prefill.onnx", "decode.onnx", "weights.data", "edgelin.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes() == (tmp_path / "c" / name).read_bytes(), name
    assert a.manifest.source == b.manifest.source == weights_sha256(ckpt)
    assert a.manifest.extra["chunk_size"] == 8 and a.manifest.model["chunk_size"] == 8
    # an in-memory model hashes to the same source as its saved checkpoint
    assert Manifest.load(in_memory).source == weights_sha256(ckpt)


def test_refuses_to_overwrite_without_force(exported, tmp_path):
    model, _ = exported("elu+1")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists; pass --force"):
        export(model, out, check=False)
    assert (out / "keep.txt").read_text() == "mine"


def test_failed_export_leaves_nothing(exported, trace_cache, tmp_path, monkeypatch):
    model, _ = exported("elu+1")
    monkeypatch.setattr(export_impl, "smoke_check", lambda *a: {"prefill": Errors(1.0, 0.5, 0, 0.1), "decode": Errors(0.0, 0.0, 0, 0.0)})
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="smoke check failed: prefill max abs error 1.00e\\+00"):
        export(model, out, trace_cache=trace_cache)  # the check fails after the trace: the run's traced graphs serve
    assert list(tmp_path.iterdir()) == []  # no OUT_DIR, no temporary folder


def test_failed_forced_export_keeps_the_old_one(exported, tmp_path, monkeypatch):
    model, previous = exported("elu+1")
    out = tmp_path / "out"
    shutil.copytree(previous, out)  # --force replaces only an edgelin export (or an empty folder)
    old = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*args, **kwargs):
        raise RuntimeError("exporter exploded\nwith a long story")

    monkeypatch.setattr(tracing, "export_graph", boom)
    with pytest.raises(ExportError, match=r"export failed \(RuntimeError: exporter exploded\); nothing was written"):
        export(model, out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


@pytest.mark.parametrize("failing", [1, 2], ids=["moving-the-old-aside", "moving-the-new-in"])
def test_a_failed_rename_leaves_the_old_export_and_no_litter(tmp_path, monkeypatch, failing):
    """replace_dir's renames: where the first (old export aside) or the second (new one in) fails, the old export
    is where it was, and neither the new folder nor the trash folder is left behind (the trash was, empty)."""
    from edgelin.runtime.files import folders as files

    out, new = tmp_path / "out", tmp_path / ".out.tmp.new"
    for folder, text in ((out, "old"), (new, "new")):
        folder.mkdir()
        (folder / "edgelin.json").write_text(text)
    monkeypatch.setattr(files, "check_output_dir", lambda *a, **k: "an edgelin export (1 file)")
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == failing:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(OutputError, match="cannot move the new export into"):
        files.replace_dir(new, out, force=True)
    shutil.rmtree(new)  # the caller removes its own folder (export does, in its except branch)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "edgelin.json").read_text() == "old"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"opset": 9}, "opset 9 is not supported", id="opset-low"),
        pytest.param({"opset": 99}, "opset 99 is not supported", id="opset-high"),
        pytest.param({"chunk_size": 0}, "chunk size 0 is out of range", id="chunk-zero"),
        pytest.param({"chunk_size": 10**6}, "chunk size 1000000 is out of range", id="chunk-huge"),
    ],
)
def test_bad_options(exported, tmp_path, kwargs, message):
    model, _ = exported("elu+1")
    with pytest.raises(ExportError, match=message):
        export(model, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        export(tmp_path / "nope", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field", ["eps", "norm_eps"])
def test_an_epsilon_the_graph_optimiser_would_drop_is_refused(tmp_path, field):
    """torch.onnx's optimiser folds "x + 1e-10" into "x": the export would divide by an exact zero where
    PyTorch divides by eps. Refused before any work, naming the field."""
    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, head_dim=8, chunk_size=8, feature_map="relu", **{field: 1e-10})
    with pytest.raises(ExportError, match=f"config field '{field}' is 1e-10, below 1e-07"):
        export(LinearLM(cfg).eval(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_lets_go_of_the_models_weights(tmp_path):
    """Once ``export`` returns and the caller drops the model, its weights are freed: torch.onnx's optimiser left
    onnxscript's module-level rewrite rules holding the last graph, whose initializers wrap the parameters (a 1.2 B
    model's 4.7 GB stayed held for the life of the process)."""
    import gc
    import weakref

    from edgelin.config import ModelConfig
    from edgelin.model import LinearLM

    model = LinearLM(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, head_dim=8, chunk_size=8)).eval()
    weights = [weakref.ref(p) for p in model.parameters()]
    export(model, tmp_path / "out")
    del model
    gc.collect()
    assert [w for w in weights if w() is not None] == []
    assert tracing.release_rewriter_state() == 0  # nothing is left for a second call to clear
