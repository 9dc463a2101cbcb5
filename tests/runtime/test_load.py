"""Loading an export: manifest and graph checks, providers, session options."""

import json
import re

from edgelin.runtime.manifest import sync_io

import numpy as np
import onnxruntime as ort
import pytest

from edgelin.errors import ManifestError, ProviderError, RuntimeInputError
from edgelin.runtime import ProviderWarning, load


def edit_manifest(export_dir, change):
    path = export_dir / "edgelin.json"
    data = json.loads(path.read_text())
    change(data)
    sync_io(data)  # io follows the edited states: the graphs, not the manifest's own consistency, are under test
    path.write_text(json.dumps(data))


def cuda_really_active(export_dir) -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    ort.set_default_logger_severity(4)
    try:
        sess = ort.InferenceSession(str(export_dir / "decode.onnx"), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    finally:
        ort.set_default_logger_severity(2)
    return sess.get_providers()[0] == "CUDAExecutionProvider"


def test_load_reads_the_manifest_and_opens_both_graphs(session, tiny):
    model, _ = tiny
    assert session.provider == "cpu"
    assert session.providers == {"prefill": ["CPUExecutionProvider"], "decode": ["CPUExecutionProvider"]}
    assert session.vocab_size == model.cfg.vocab_size
    assert [s.input for s in session.manifest.states] == [f"state.{s.key}" for s in model.state_specs()]


def test_a_folder_that_does_not_exist(tmp_path):
    with pytest.raises(ManifestError, match="is not a folder"):
        load(tmp_path / "nope")


def test_a_folder_that_is_not_an_export(tmp_path):
    (tmp_path / "prefill.onnx").write_bytes(b"")
    with pytest.raises(ManifestError, match="not an edgelin export: it has no edgelin.json"):
        load(tmp_path)


def test_a_manifest_of_another_version(export_copy):
    edit_manifest(export_copy, lambda d: d.update(format="edgelin/3"))
    with pytest.raises(ManifestError, match="format 'edgelin/3'.*re-export"):
        load(export_copy, provider="cpu")


def test_a_manifest_that_is_not_json(export_copy):
    (export_copy / "edgelin.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load(export_copy, provider="cpu")


def test_a_missing_graph_file(export_copy):
    (export_copy / "decode.onnx").unlink()
    with pytest.raises(ManifestError, match="lacks decode.onnx, the decode graph"):
        load(export_copy, provider="cpu")


def test_a_corrupt_graph_file(export_copy):
    (export_copy / "prefill.onnx").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ManifestError, match="prefill.onnx is not the file edgelin.json describes"):
        load(export_copy, provider="cpu")  # the hash check, before ONNX Runtime reads it
    with pytest.raises(ManifestError, match="ONNX Runtime cannot load .*prefill.onnx"):
        load(export_copy, provider="cpu", check_hashes=False)


def test_a_state_dtype_the_graphs_do_not_have(export_copy):
    edit_manifest(export_copy, lambda d: d["states"][0].update(dtype="float16"))
    with pytest.raises(ManifestError) as err:
        load(export_copy, provider="cpu")
    msg = str(err.value)
    assert "prefill.onnx input 'state.0.S' is tensor(float), the manifest says float16" in msg
    assert "decode.onnx input 'state.0.S'" in msg and "present.0.S" in msg
    assert "\n" not in msg


def test_a_state_the_graphs_do_not_have(export_copy):
    extra = {"input": "state.9.S", "output": "present.9.S", "shape": ["batch", 2], "dtype": "float32", "init": 0.0}
    edit_manifest(export_copy, lambda d: d["states"].append(extra))
    with pytest.raises(ManifestError, match="prefill.onnx has no input 'state.9.S'.*decode.onnx has no input 'state.9.S'"):
        load(export_copy, provider="cpu")


def test_a_graph_input_the_manifest_does_not_name(export_copy):
    dropped = []
    edit_manifest(export_copy, lambda d: dropped.append(d["states"].pop()["input"]))
    with pytest.raises(ManifestError, match=f"prefill.onnx has input '{dropped[0]}' that the manifest does not name"):
        load(export_copy, provider="cpu")


def test_a_state_rank_or_size_that_differs(export_copy):
    def change(d):
        d["states"][0]["shape"] = ["batch", 2, 32]  # rank 3 instead of 4
        d["states"][1]["shape"] = ["batch", 2, 17]  # z is [batch, 2, 16]
    edit_manifest(export_copy, change)
    with pytest.raises(ManifestError) as err:
        load(export_copy, provider="cpu")
    assert "input 'state.0.S' has rank 4, the manifest says 3" in str(err.value)
    assert "input 'state.0.z' has shape" in str(err.value)


def test_renamed_logits(export_copy):
    edit_manifest(export_copy, lambda d: d.update(logits="scores"))
    with pytest.raises(ManifestError, match="prefill.onnx has no output 'scores'"):
        load(export_copy, provider="cpu")


def test_graphs_from_two_exports(export_copy, exported):
    _, other = exported("relu")
    (export_copy / "decode.onnx").write_bytes((other / "decode.onnx").read_bytes())
    with pytest.raises(ManifestError, match="decode.onnx is not the file edgelin.json describes"):
        load(export_copy, provider="cpu")
    with pytest.raises(ManifestError, match="decode.onnx was exported from another model .*files from two exports"):
        load(export_copy, provider="cpu", check_hashes=False)  # the embedded manifest tells too


def test_an_unknown_provider(tiny):
    with pytest.raises(RuntimeInputError, match="provider must be one of auto, cpu, cuda, openvino"):
        load(tiny[1], provider="gpu")


def test_cuda_is_claimed_only_when_active(tiny):
    if cuda_really_active(tiny[1]):
        session = load(tiny[1], provider="cuda")
        assert session.provider == "cuda"
        assert all(p[0] == "CUDAExecutionProvider" for p in session.providers.values())
    else:
        with pytest.raises(ProviderError, match="CUDA was requested but .*use --provider cpu"):
            load(tiny[1], provider="cuda")


@pytest.mark.parametrize("gpu", [True, None, False], ids=["gpu-visible", "cannot-tell", "no-gpu"])
def test_auto_falls_back_to_cpu_warning_only_where_a_gpu_is_seen(tiny, monkeypatch, gpu):
    """Where the machine shows an NVIDIA GPU (or cannot tell) and CUDA does not activate: CPU with a warning. On a
    machine without one: CPU, quietly (it warned on every run of a CPU-only machine with onnxruntime-gpu)."""
    import warnings

    from edgelin.runtime import providers as providers_module

    if cuda_really_active(tiny[1]):
        assert load(tiny[1], provider="auto").provider == "cuda"
        return
    monkeypatch.setattr(providers_module, "gpu_visible", lambda: gpu)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        session = load(tiny[1], provider="auto")
    assert session.provider == "cpu" and session.providers["decode"] == ["CPUExecutionProvider"]
    said = [str(w.message) for w in said if issubclass(w.category, ProviderWarning)]
    if gpu is not False and "CUDAExecutionProvider" in ort.get_available_providers():  # onnxruntime-gpu, no working GPU
        assert len(said) == 1 and re.search("CUDA is not active.*running on CPU", said[0]), said
    else:
        assert said == []



def test_ort_does_not_print_its_cuda_error(tiny, capfd):
    try:
        load(tiny[1], provider="auto")
    except ProviderError:
        pass
    assert "Failed to load library" not in capfd.readouterr().err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(threads=0), "threads"), (dict(threads=2.0), "threads"), (dict(optimization="max"), "optimization"),
        (dict(session_options={"no_such_option": 1}), "no attribute 'no_such_option'"),
        (dict(session_options={"enable_profiling": "yes please"}), "wrong type"),
    ],
    ids=["threads0", "threads-float", "optimization", "session-option", "session-option-type"],
)
def test_bad_session_options(tiny, kwargs, match):
    with pytest.raises(RuntimeInputError, match=match):
        load(tiny[1], provider="cpu", **kwargs)


def test_session_options_are_applied(tiny, tmp_path):
    session = load(
        tiny[1], provider="cpu", threads=1, optimization="basic", save_optimized=tmp_path / "opt",
        session_options={"enable_mem_pattern": False},
    )
    assert (tmp_path / "opt" / "prefill.optimized.onnx").is_file()
    assert (tmp_path / "opt" / "decode.optimized.onnx").is_file()
    logits = session.prefill(np.arange(10)[None], session.new_state(1))
    assert logits.shape == (1, 10, 256)
