"""edgelin's import of flash-linear-attention LinearAttention checkpoints against fla's own model.

Each case is a tiny random fla model (built and saved with the real package) exercising one config option.
fla runs its real kernels (``fused_recurrent``, in Triton's CPU interpreter, see conftest.py) over 69 prompt
tokens (a chunk of 64 and 5 more) and 12 decode steps, batch 2: fla's defaults case through its cache one step at a time, the others in one
forward (``STEPWISE``; conftest.run). edgelin's import runs the same tokens through its chunked
form (prefill) and its recurrent step (decode). Budget, fp32: max abs logits error <= 1e-4 at every position.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

from edgelin.checkpoint import load_checkpoint
from edgelin.exporters import export
from edgelin.runtime.manifest import Manifest
from edgelin.validate import validate
from testkit import max_abs

MAX_ABS = 1e-4
STATE_REL = 1e-5  # the running sums S and z, relative L2
BATCH, PROMPT, STEPS = 2, 69, 12  # past a chunk boundary (fla in the interpreter costs by the token)

CASES = {  # id -> fla config options (and how to save)
    "default-elementwise_product": {},  # fla's defaults: learned q and k maps, no denominator
    "elementwise_product-tied": {"tie_feature_map_qk": True, "tied_save": True},
    "elu-denominator": {"feature_map": "elu", "norm_feature_map": True},
    "relu-denominator": {"feature_map": "relu", "norm_feature_map": True},
    "identity": {"feature_map": "identity"},
    "hedgehog-denominator": {"feature_map": "hedgehog", "norm_feature_map": True},
    "t2r-tied": {"feature_map": "t2r", "tie_feature_map_qk": True, "tied_save": True},
    "dpfp-denominator": {"feature_map": "dpfp", "norm_feature_map": True},
    "norm_q-norm_k": {"feature_map": "elu", "norm_q": True, "norm_k": True, "norm_feature_map": True},
    "kv_heads2-denominator": {"num_kv_heads": 2, "feature_map": "elu", "norm_feature_map": True},
    "kv_heads1-hedgehog": {"num_kv_heads": 1, "feature_map": "hedgehog"},
    "expand_k-expand_v": {"expand_k": 0.5, "expand_v": 2.0},
    "tied_embeddings-no_affine": {"tie_word_embeddings": True, "elementwise_affine": False},
    "mlp_rounding-norm_eps-unfused": {
        "intermediate_size": None, "hidden_ratio": 3, "norm_eps": 1e-3, "fuse_norm": False, "fuse_swiglu": False,
    },
}
# The ONNX export of a few cases that together use every kind of graph piece: learned untied maps, grouped
# heads with the denominator, a wider feature map built from slices, a weightless norm and tied embeddings.
EXPORTED = ("default-elementwise_product", "kv_heads2-denominator", "dpfp-denominator", "tied_embeddings-no_affine")

STEPWISE = ("default-elementwise_product",)  # fla's own decode path through its cache; the rest in one forward
_RESULTS: dict[str, tuple] = {}


def same_worker(case_ids):
    """The cases as params; an exported case's import and export tests share one xdist worker (its group), so
    fla's run of it (the slow part: fla's kernels in Triton's interpreter) happens once, not once per worker."""
    return [pytest.param(c, marks=pytest.mark.xdist_group(f"fla-{c}")) if c in EXPORTED else c for c in case_ids]


def fla_case(case_id: str, fla_oracle, tmp_path_factory):
    """(checkpoint folder, prompt, steps, fla's results) for one case; fla runs once per case per session."""
    if case_id not in _RESULTS:
        options = CASES[case_id]
        folder = fla_oracle.build(tmp_path_factory.mktemp(case_id), **options)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, fla_oracle.TINY["vocab_size"], (BATCH, PROMPT), generator=gen)
        steps = torch.randint(0, fla_oracle.TINY["vocab_size"], (BATCH, STEPS), generator=gen)
        fused = not options  # fla's defaults end to end, its fused RMSNorm and SwiGLU kernels included
        _RESULTS[case_id] = folder, prompt, steps, fla_oracle.run(
            fla_oracle.load(folder, fused=fused), prompt, steps, stepwise=case_id in STEPWISE)
    return _RESULTS[case_id]


@pytest.mark.parametrize("case_id", same_worker(CASES))
def test_import_matches_fla(case_id, fla_oracle, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_states) = fla_case(case_id, fla_oracle, tmp_path_factory)
    model, state = fla_oracle.import_vs_fla(folder, prompt, steps[:, :STEPS], ref_prefill, ref_decode, MAX_ABS)
    # the state: carried per key/value head; fla repeats it for every query head of a group
    o = model.blocks[0].attn.o
    groups = o.num_heads // o.num_kv_heads
    for layer, ref in enumerate(ref_states):
        assert sorted(f"{layer}.{n}" for n in ref) == sorted(n for n in state if n.startswith(f"{layer}."))
        for name, r in ref.items():
            got, r = state[f"{layer}.{name}"].double(), r[:, ::groups].double()
            assert got.shape == r.shape, f"{layer}.{name}: {tuple(got.shape)} != {tuple(r.shape)}"
            rel = ((got - r).norm() / r.norm()).item()
            assert rel <= STATE_REL, f"{layer}.{name}: relative L2 {rel:.2e}"


@pytest.mark.parametrize("case_id", same_worker(EXPORTED))
def test_export_matches_fla(case_id, fla_oracle, tmp_path_factory):
    """The two ONNX graphs through edgelin's runtime (ONNX Runtime, CPU) against fla; then edgelin's validate
    of the export against the checkpoint passes."""
    folder, prompt, steps, (ref_prefill, ref_decode, _) = fla_case(case_id, fla_oracle, tmp_path_factory)
    out = tmp_path_factory.mktemp(f"{case_id}-export") / "export"
    export(folder, out, check=False)
    manifest = Manifest.load(out)
    assert manifest.model["family"] == "fla/linear_attn" and manifest.model["source_config"]["model_type"] == "linear_attn"
    fla_oracle.export_vs_fla(out, prompt, steps[:, :STEPS], ref_prefill, ref_decode, MAX_ABS)
    report = validate(out, folder, steps=24, long=300)  # what `edgelin validate OUT --checkpoint PATH` runs
    assert report.passed, report.table()


def test_zero_denominator_stays_finite_in_the_graphs(fla_oracle, tmp_path):
    """Keys of zero make dpfp's features zero, so the denominator is exactly 0 and fla gives 0 / (0 + eps) = 0.
    The exported graphs must keep the epsilon (an optimizer that drops tiny constants would give NaN)."""
    folder = fla_oracle.build(tmp_path / "ckpt", feature_map="dpfp", norm_feature_map=True)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.attn.k_proj.weight"].zero_()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    export(folder, tmp_path / "out", check=False)
    manifest = Manifest.load(tmp_path / "out")
    ids = torch.randint(0, fla_oracle.TINY["vocab_size"], (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, ref_state = load_checkpoint(folder)(ids)
    assert torch.isfinite(ref).all() and not ref_state["0.z"].any()
    for graph, tokens in (("prefill", ids), ("decode", ids[:, :1])):
        session = ort.InferenceSession(str(tmp_path / "out" / manifest.graphs[graph]), providers=["CPUExecutionProvider"])
        feeds = {manifest.input_ids: tokens.numpy(), **{s.input: np.zeros(s.concrete_shape(2), s.np_dtype) for s in manifest.states}}
        if graph == "prefill":
            feeds |= manifest.prefill_positions(*tokens.shape)
        logits = session.run(None, feeds)[0]
        assert np.isfinite(logits).all(), f"{graph}: non-finite logits"
        assert max_abs(torch.from_numpy(logits), ref[:, : tokens.shape[1]]) <= MAX_ABS
