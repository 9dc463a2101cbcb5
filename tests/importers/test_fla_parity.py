"""edgelin's import of flash-linear-attention LinearAttention checkpoints against fla's own model.

Each case is a tiny random fla model (built and saved with the real package) exercising one config option.
fla runs its real kernels (``fused_recurrent``, in Triton's CPU interpreter, see conftest.py): a prefill of
150 tokens, then 20 cached decode steps, batch 2. edgelin's import runs the same tokens through its chunked
form (prefill) and its recurrent step (decode). Budget, fp32: max abs logits error <= 1e-4 at every position.
"""

from __future__ import annotations

import pytest
import torch

from edgelin.checkpoint import load_checkpoint

MAX_ABS = 1e-4
STATE_REL = 1e-5  # the running sums S and z, relative L2
BATCH, PROMPT, STEPS = 2, 150, 20

CASES = [
    pytest.param({}, id="default-elementwise_product"),  # fla's defaults: learned q and k maps, no denominator
    pytest.param({"tie_feature_map_qk": True, "tied_save": True}, id="elementwise_product-tied"),
    pytest.param({"feature_map": "elu", "norm_feature_map": True}, id="elu-denominator"),
    pytest.param({"feature_map": "relu", "norm_feature_map": True}, id="relu-denominator"),
    pytest.param({"feature_map": "identity"}, id="identity"),
    pytest.param({"feature_map": "hedgehog", "norm_feature_map": True}, id="hedgehog-denominator"),
    pytest.param({"feature_map": "t2r", "tie_feature_map_qk": True, "tied_save": True}, id="t2r-tied"),
    pytest.param({"feature_map": "dpfp", "norm_feature_map": True}, id="dpfp-denominator"),
    pytest.param({"feature_map": "elu", "norm_q": True, "norm_k": True, "norm_feature_map": True}, id="norm_q-norm_k"),
    pytest.param({"num_kv_heads": 2, "feature_map": "elu", "norm_feature_map": True}, id="kv_heads2-denominator"),
    pytest.param({"num_kv_heads": 1, "feature_map": "hedgehog"}, id="kv_heads1-hedgehog"),
    pytest.param({"expand_k": 0.5, "expand_v": 2.0}, id="expand_k-expand_v"),
    pytest.param({"tie_word_embeddings": True, "elementwise_affine": False}, id="tied_embeddings-no_affine"),
    pytest.param({"intermediate_size": None, "hidden_ratio": 3, "norm_eps": 1e-3, "fuse_norm": False, "fuse_swiglu": False}, id="mlp_rounding-norm_eps-unfused"),
]


@pytest.fixture(scope="module", params=CASES)
def case(request, fla_oracle, tmp_path_factory):
    """(options, checkpoint folder, tokens, fla's results) for one config; fla runs once per case."""
    options = request.param
    folder = fla_oracle.build(tmp_path_factory.mktemp("fla"), **options)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, fla_oracle.TINY["vocab_size"], (BATCH, PROMPT), generator=gen)
    steps = torch.randint(0, fla_oracle.TINY["vocab_size"], (BATCH, STEPS), generator=gen)
    return options, folder, prompt, steps, fla_oracle.run(fla_oracle.load(folder), prompt, steps)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_import_matches_fla(case):
    options, folder, prompt, steps, (ref_prefill, ref_decode, ref_states) = case
    assert ref_prefill.std() > 0.5, "logits without spread would hide errors"
    model = load_checkpoint(folder)
    with torch.no_grad():
        logits, state = model(prompt)
        prefill = max_abs(logits, ref_prefill)
        decode = 0.0
        for t in range(STEPS):
            logits, state = model.step(steps[:, t : t + 1], state)
            decode = max(decode, max_abs(logits, ref_decode[t]))
    print(f"\n{options}: max abs logits vs fla: prefill {prefill:.2e}, decode {decode:.2e}")
    assert prefill <= MAX_ABS, f"prefill: max abs {prefill:.2e} > {MAX_ABS}"
    assert decode <= MAX_ABS, f"decode: max abs {decode:.2e} > {MAX_ABS}"
    # the state: carried per key/value head; fla repeats it for every query head of a group
    groups = model.options.num_heads // model.options.num_kv_heads
    for layer, ref in enumerate(ref_states):
        assert sorted(ref) == sorted(n for n in state if n.startswith(f"{layer}.")) or sorted(f"{layer}.{n}" for n in ref) == sorted(
            n for n in state if n.startswith(f"{layer}.")
        )
        for name, r in ref.items():
            got, r = state[f"{layer}.{name}"].double(), r[:, ::groups].double()
            assert got.shape == r.shape, f"{layer}.{name}: {tuple(got.shape)} != {tuple(r.shape)}"
            rel = ((got - r).norm() / r.norm()).item()
            assert rel <= STATE_REL, f"{layer}.{name}: relative L2 {rel:.2e}"
