"""The traced graphs' weights left unwritten (``edgelin.exporters.deferred``): a data file with holes where the model's
parameters (or views of them, such as a folded Transpose) would be, read back through the parameters by every reader,
and an export made so that is byte for byte the export whose traced graphs were written in full."""

from __future__ import annotations

import filecmp
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from edgelin import streaming
from edgelin.checkpoint import save_checkpoint
from edgelin.config import ModelConfig
from edgelin.errors import ExportError
from edgelin.exporters import deferred, export, weights
from edgelin.model import LinearLM


def _graph(params: dict[str, torch.nn.Parameter]) -> ir.Model:
    """A graph whose initializers are a parameter as torch.onnx hands it over, a transposed NumPy view of another (a
    folded Transpose), a fresh array, a small view (kept inline) and, last, a second parameter."""
    from torch.onnx._internal.exporter._core import TorchTensor

    fresh = np.arange(300, dtype=np.float32).reshape(3, 100)
    values = {
        "w": TorchTensor(params["w"].detach(), "w"),
        "w_t": ir.Tensor(params["u"].detach().numpy().T, name="w_t"),
        "fresh": ir.Tensor(fresh, name="fresh"),
        "small": ir.Tensor(params["b"].detach().numpy()[:8], name="small"),
        "last": TorchTensor(params["z"].detach(), "last"),
    }
    inits = [ir.Value(name=k, shape=ir.Shape(v.shape), type=ir.TensorType(v.dtype), const_value=v) for k, v in values.items()]
    x = ir.Value(name="x", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.Node("", "Identity", [x], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=inits, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


@pytest.fixture
def params():
    torch.manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(40, 30)), "u": torch.nn.Parameter(torch.randn(50, 20)),
            "b": torch.nn.Parameter(torch.randn(64)), "z": torch.nn.Parameter(torch.randn(70, 3))}


def test_held_weights_are_holes_read_back_from_the_parameters(params, tmp_path, monkeypatch):
    full, held = tmp_path / "full", tmp_path / "held"
    full.mkdir(), held.mkdir()
    ir.save(_graph(params), str(full / "g.onnx"), external_data="g.onnx.data")  # torch.onnx's own save
    model = torch.nn.Module()
    for k, p in params.items():
        model.register_parameter(k, p)
    monkeypatch.setattr(deferred, "PIECE", 256)  # a tensor in several pieces, a row split where it is larger
    with deferred.deferring(model) as d:
        assert deferred.save(_graph(params), held / "g.onnx") == 3  # w, w_t, last; not the fresh array, not the inline one
        data = held / "g.onnx.data"
        assert (held / "g.onnx").read_bytes() == (full / "g.onnx").read_bytes()  # the same graph, the same layout
        assert data.stat().st_size == (full / "g.onnx.data").stat().st_size  # the last tensor a hole: the length all the same
        assert b"".join(deferred.file_pieces(data, 100)) == (full / "g.onnx.data").read_bytes()
        assert data.read_bytes() != (full / "g.onnx.data").read_bytes()  # holes: zeros where the weights would be
        proto = onnx.load(str(held / "g.onnx"), load_external_data=False)
        theirs = {t.name: t for t in onnx.load(str(full / "g.onnx")).graph.initializer}
        for t in weights.initializers(proto.graph):
            want = onnx.numpy_helper.to_array(theirs[t.name])
            assert np.array_equal(weights.tensor_values(t, held), want), t.name
            if t.data_location == onnx.TensorProto.EXTERNAL:
                assert weights.read_external(t, held) == want.tobytes(), t.name
        assert np.shares_memory(weights.tensor_values(next(t for t in proto.graph.initializer if t.name == "w_t"), held),
                                params["u"].detach().numpy())  # a view: the bytes are not copied to be read
        w = next(t for t in proto.graph.initializer if t.name == "w")
        source, offset, length = weights.external_range(w, held)
        with pytest.raises(ExportError, match="read across the tensor held"):
            list(weights._read_range(source, offset + 4, length - 4))
        with pytest.raises(ExportError, match="held as float32 \\[40, 30\\], read as float32 \\[30, 40\\]"):
            deferred.values(source, offset, length, np.dtype(np.float32), (30, 40))
        assert d.count == 3
        data.write_bytes(data.read_bytes())  # the file written anew (as a converter replaces it): no longer held
        assert deferred.pieces(source, offset, length) is None and d.count == 0
    assert deferred.active() is None


def test_a_parameter_not_of_the_model_and_deferral_switched_off_are_written(params, tmp_path, monkeypatch):
    other = torch.nn.Linear(2, 2)  # the deferral's model: none of the graph's tensors are its parameters
    with deferred.deferring(other):
        assert deferred.save(_graph(params), tmp_path / "g.onnx") == 0
    monkeypatch.setattr(deferred, "ENABLED", False)
    with deferred.deferring(other) as d:
        assert d is None and deferred.active() is None


def test_an_export_that_leaves_the_traced_weights_unwritten_is_the_same_bytes(tmp_path, monkeypatch):
    """A streamed export of an untied model at fp32 (its weights stored from the holes' parameters), int4 and int8
    (quantised from them; the decode graph's weights referred to in the prefill graph's converted file, not made and
    written again: ``weights.Reuse``), each traced afresh, against the same exports with every traced graph written in
    full (where nothing is a parameter's view, so nothing is referred to). A quantised export lets its model go, and the
    scratch file mapped under it, before the weights file is written (the scratch's disk is then free again)."""
    from edgelin.exporters import exporter

    torch.manual_seed(0)
    model = LinearLM(ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, head_dim=32, chunk_size=16, tie_embeddings=False))
    folder = save_checkpoint(model.eval(), tmp_path / "ckpt")  # d_model 64: the int4 weights are large enough for the data file
    saved, before_store, scratch_at_store, maps = [], {}, [], Path("/proc/self/maps")
    real, store = deferred.save, exporter.store_once
    monkeypatch.setattr(deferred, "save", lambda m, path: saved.append((path.name, real(m, path))) or saved[-1][1])

    def store_once(tmp, files):  # where the decode graph's quantised weights are as the store finds them
        decode = onnx.load(str(tmp / "decode.onnx"), load_external_data=False)
        inits = {t.name: {e.key: e.value for e in t.external_data}.get("location") for t in decode.graph.initializer}
        before_store[precision, deferred.ENABLED] = [inits[n.input[1]] for n in decode.graph.node if n.op_type in ("MatMulNBits", "MatMulInteger")
                                                     and "head" not in n.input[1]]  # int4's untied head: a table, made per graph
        if maps.exists():  # the model let go, its scratch file's disk with it, before the weights file is written
            scratch_at_store.append(sum(streaming.SCRATCH_FILE in line for line in maps.read_text().splitlines()))
        return store(tmp, files)

    monkeypatch.setattr(exporter, "store_once", store_once)
    precisions = ("fp32", "int4", "int8")
    for precision in precisions:
        export(folder, tmp_path / f"held-{precision}", check=False, precision=precision)
    assert [n for n, _ in saved] == ["prefill.onnx", "decode.onnx"] * 3 and all(k > 10 for _, k in saved), saved
    for precision in ("int4", "int8"):  # the decode graph's quantised weights: in the prefill graph's file
        spill = {"int4": "q4", "int8": "q8"}[precision]  # the converter's spill file, adopted as a data file of the graph
        assert len(before_store[precision, True]) == {"int4": 14, "int8": 15}[precision] and set(before_store[precision, True]) == {f"prefill.onnx.{spill}"}, precision
    monkeypatch.setattr(deferred, "ENABLED", False)
    for precision in precisions:  # the second and third from the first's trace, written in full
        export(folder, tmp_path / f"full-{precision}", check=False, precision=precision, trace_cache=tmp_path / "traces")
        names = sorted(p.name for p in (tmp_path / f"full-{precision}").iterdir())
        assert names == sorted(p.name for p in (tmp_path / f"held-{precision}").iterdir())
        assert [n for n in names if not filecmp.cmp(tmp_path / f"held-{precision}" / n, tmp_path / f"full-{precision}" / n, shallow=False)] == []
    assert len(saved) == 6
    # fp32's store reads the weights from the parameters, mapped from the scratch file; int4 and int8 wrote theirs
    assert scratch_at_store == ([1, 0, 0] * 2 if maps.exists() else []), scratch_at_store
    for precision in ("int4", "int8"):  # each graph's own
        assert set(before_store[precision, False]) == {f"decode.onnx.{precision.replace('int', 'q')}"}, precision
