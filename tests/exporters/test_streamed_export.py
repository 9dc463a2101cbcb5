"""The streamed export (``edgelin.streaming``, ``export(..., streamed=True)``): a checkpoint's weights read one tensor at a
time into a scratch file and mapped from it. Its files are the bytes the in-memory export writes, and it exports a
model whose float32 weights exceed a memory limit imposed on the process, which the in-memory export cannot."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from edgelin import streaming
from edgelin.checkpoint import load_checkpoint, save_checkpoint
from edgelin.config import ModelConfig
from edgelin.errors import CheckpointError, ExportError
from edgelin.exporters import export
from edgelin.model import LinearLM


def _tiny(tie: bool = True) -> LinearLM:
    torch.manual_seed(0)
    return LinearLM(ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=16, chunk_size=16,
                                tie_embeddings=tie)).eval()


def test_mapped_parameters_equal_the_checkpoint_share_ties_and_leave_no_file(tmp_path):
    model = _tiny()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    before = (folder / "model.safetensors").read_bytes()
    with streaming.mapped_weights(tmp_path):
        mapped = load_checkpoint(folder)
    assert not (tmp_path / streaming.SCRATCH_FILE).exists()  # unlinked once mapped: nothing to clean up
    assert streaming.meta_parameters(mapped) == []
    ours, theirs = dict(model.named_parameters()), dict(mapped.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert {n: b for n, b in model.named_buffers()}.keys() == {n: b for n, b in mapped.named_buffers()}.keys()
    for (name, b), (_, c) in zip(model.named_buffers(), mapped.named_buffers()):
        assert torch.equal(b, c), name
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        assert torch.equal(model(ids)[0], mapped(ids)[0])
        next(mapped.parameters()).mul_(2.0)  # an importer that scales a weight in place writes to the scratch pages
    assert (folder / "model.safetensors").read_bytes() == before


def test_plain_reader_reads_what_safetensors_reads(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).to(torch.float16),
               "d": torch.arange(6, dtype=torch.int64).reshape(2, 3), "e": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as theirs, streaming.SafetensorsReader(tmp_path / "w.safetensors") as ours:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for name in theirs.keys():
            got, want = ours.get_tensor(name), theirs.get_tensor(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
    assert streaming.header_shapes(tmp_path / "w.safetensors")["a"] == (3, 5)
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with streaming.SafetensorsReader(tmp_path / "cut.safetensors") as cut, pytest.raises(ValueError, match="ends inside tensor"):
        for name in cut.keys():
            cut.get_tensor(name)
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="bad.safetensors is not a readable safetensors file"):
        streaming.header_shapes(tmp_path / "bad.safetensors")


def test_a_shared_parameter_is_mapped_once_for_every_module(tmp_path):
    torch.manual_seed(0)
    toy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    toy[1].weight = toy[0].weight  # tied: one Parameter, two names in the state dict
    values = {n: t.clone() for n, t in toy.state_dict().items()}
    streaming.map_parameters(toy, iter(values.items()), tmp_path)
    assert toy[1].weight is toy[0].weight
    assert all(torch.equal(t, values[n]) for n, t in toy.state_dict().items())
    assert toy[0].weight.data_ptr() != toy[0].bias.data_ptr()


def test_unmapped_parameter_refused(tmp_path, monkeypatch):
    folder = save_checkpoint(_tiny(), tmp_path / "ckpt")
    real = streaming.map_parameters
    monkeypatch.setattr(streaming, "map_parameters", lambda model, tensors, where: real(
        model, ((n, t) for n, t in tensors if not n.endswith("attn_norm.weight")), where))
    with streaming.mapped_weights(tmp_path), pytest.raises(CheckpointError, match=r"no tensor holds parameter\(s\) .*attn_norm.weight"):
        load_checkpoint(folder)


def test_streamed_refusals(tmp_path, monkeypatch):
    with pytest.raises(ExportError, match="a streamed export reads a checkpoint folder"):
        export(_tiny(), tmp_path / "a", streamed=True)
    folder = save_checkpoint(_tiny(), tmp_path / "ckpt")
    monkeypatch.setattr("edgelin.exporters.source.available_memory", lambda: 10_000)
    with pytest.raises(ExportError, match=r"largest tensor \(embed.weight in model.safetensors, 8,192 values\) needs 65,536 bytes"):
        export(folder, tmp_path / "b", streamed=True)
    assert not (tmp_path / "b").exists()


def test_streamed_export_is_the_same_bytes(bundled_exports, tmp_path):
    """The bundled model exported with its weights in memory, traced afresh, against the run's shared export of it
    (streamed, the default for a checkpoint folder): every file byte for byte."""
    from edgelin.models import bundled_checkpoint

    shared = bundled_exports("fp32")
    in_memory = export(bundled_checkpoint(), tmp_path / "in_memory", streamed=False)
    assert not in_memory.streamed and "mapped from a scratch file" not in in_memory.summary()
    names = sorted(p.name for p in shared.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "in_memory").iterdir())
    assert [n for n in names if not filecmp.cmp(shared / n, tmp_path / "in_memory" / n, shallow=False)] == []


# A model whose float32 weights (1.34 GB: 2 layers of width 2,048 with a 16x MLP, an untied 8,192-token table and head)
# are more than twice the data the child may allocate beyond what its imports took (HEADROOM). Measured (VmData
# sampled every 10 ms, torch at 1 thread, no smoke check): the imports ~250 MB; the streamed export of this model
# peaked at ~650 MB, ~400 MB above them; the in-memory one needs the weights on top.
BIG = dict(vocab_size=8192, d_model=2048, n_layers=2, n_heads=8, head_dim=256, chunk_size=16, tie_embeddings=False, mlp_ratio=16.0)
HEADROOM = 600 << 20

# RLIMIT_DATA counts private writable memory: what the process allocates, not the pages of files it maps shared (the
# streamed weights) or read-only. The export runs without its smoke check: ONNX Runtime maps weights.data
# copy-on-write once per session, which the limit counts as that file's size per session although those pages are
# the file's (measured: +2.1 GB of VmData for 4 sessions of a 537 MB export).
# The child also samples the disk its export's folders take (allocated blocks, every 20 ms, beside the checkpoint): the
# traced graphs' float32 weights are never written (edgelin.exporters.deferred), so that stays below the weights' size.
CHILD = textwrap.dedent("""
    import json, os, resource, sys, threading, time
    folder, out, streamed, headroom = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    import onnx, onnxruntime, torch
    torch.set_num_threads(1)
    from edgelin.exporters import export
    imports = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmData:"))
    resource.setrlimit(resource.RLIMIT_DATA, (imports + headroom, imports + headroom))
    beside, peak, done = os.path.dirname(out), [0], threading.Event()
    def sample():
        while not done.wait(0.02):
            taken = 0
            for root, dirs, files in os.walk(beside):
                dirs[:] = [d for d in dirs if os.path.join(root, d) != folder]
                for f in files:
                    try:
                        taken += os.stat(os.path.join(root, f)).st_blocks * 512
                    except OSError:
                        pass
            peak[0] = max(peak[0], taken)
    threading.Thread(target=sample, daemon=True).start()
    result = export(folder, out, streamed=streamed, check=False, precision="int4")
    done.set()
    print(json.dumps({"streamed": result.streamed, "limit": imports + headroom, "disk_peak": peak[0]}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmData from /proc (Linux)")
def test_export_beyond_a_memory_limit(tmp_path):
    """A model whose float32 weights are more than twice the memory the export may take beyond its imports: the
    streamed export (the default for a checkpoint folder) writes it in int4 (the float32 graphs traced from the mapped
    weights, then converted one tensor at a time, their weights read from the parameters, never written in float32);
    the same export holding the weights in memory fails, and leaves nothing behind."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = LinearLM(ModelConfig(**BIG)).eval()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(model.state_dict(), folder / "model.safetensors")  # from the tensors themselves: no second copy in memory
    (folder / "config.json").write_text(model.cfg.to_json(), encoding="utf-8")
    del model
    weights = (folder / "model.safetensors").stat().st_size
    assert weights > 2 * HEADROOM

    def child(streamed: bool) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tmp_path / f"out{int(streamed)}"), str(int(streamed)),
                               str(HEADROOM)], capture_output=True, text=True, timeout=900)

    done = child(True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["streamed"]
    # the scratch file is unlinked once mapped: what the folders took is the export's own files, never a traced graph's
    # float32 weights (a graph written in full would hold all of them: more than the checkpoint's float32 bytes)
    assert 0 < said["disk_peak"] < weights, (said["disk_peak"], weights)
    manifest = json.loads((tmp_path / "out1" / "edgelin.json").read_text())
    assert manifest["precision"] == "int4"
    assert weights / 8 < (tmp_path / "out1" / "weights.data").stat().st_size < weights / 4  # 4-bit blocks, an 8-bit table
    refused = child(False)  # the same export with the weights in memory: over the limit
    assert refused.returncode != 0
    assert "Cannot allocate memory" in refused.stderr or "MemoryError" in refused.stderr or "can't allocate" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "out0").exists()
