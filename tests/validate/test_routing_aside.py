"""validate on a mixture-of-experts export whose routing differs from the reference at a crafted near tie: the routing
check reports the flips (not hidden), the prefill and decode checks set exactly those tokens aside, say how many, and
hold every other token's logits to the fp32 budget; the tokens set aside are far off (holding them would fail).

The tie: two experts' router rows are equal, so their scores are equal on every token; ONNX's TopK takes the lower
index, and the reference is the same model with a choice-only bias of 1e-6 on the higher one (the scores, hence the
routing weights, unchanged). Where exactly one of the two is among a token's top 2, the export and the reference
choose differently and nothing else differs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edgelin.layers.moe import MoE, MoEOptions, moe_layers
from edgelin.layers.short_conv import GatedShortConv
from edgelin.layers.mlp import SwiGLU
from edgelin.skeleton import CausalLM
from edgelin.validate.routing import reference_routing

D, E, VOCAB = 32, 4, 97
TIED, OTHER = 1, 3  # the experts whose router rows are tied in the export's model


def tiny_moe_lm(seed: int = 0) -> CausalLM:
    """Two short-conv layers; the first with a dense SwiGLU, the last with 4 experts, top 2. The last layer's MLP is
    the only MoE, so a token whose experts differ changes that token's logits and nothing after it."""
    torch.manual_seed(seed)
    options = MoEOptions(d_model=D, num_experts=E, top_k=2, expert_hidden=16, score_bias=True)
    model = CausalLM(
        lambda i: GatedShortConv(D, 3, bias=False), n_layers=2, vocab_size=VOCAB, d_model=D, mlp_hidden=32, norm_eps=1e-5,
        tie_embeddings=True, chunk_size=16, config={"family": "test/moe-aside", "chunk_size": 16},
        mlp=lambda i: SwiGLU if i == 0 else (lambda sizes: MoE(options)),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
        for block in model.blocks:
            block.attn_norm.weight.fill_(1.0)
            block.mlp_norm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        moe = moe_layers(model)[0]
        moe.router.weight[OTHER] = moe.router.weight[TIED]  # an exact tie: ONNX's TopK takes the lower index
        moe.expert_bias.zero_()
        for i, expert in enumerate(moe.experts):  # experts far apart, so that another choice moves the logits
            expert.down.weight.mul_(1.0 + 2.0 * i)
    return model.eval()


@pytest.fixture(scope="module")
def export_and_nudged(tmp_path_factory):
    """The tie exported (fp32, no smoke check: torch.topk may break the tie either way), and the reference with a
    choice-only bias of 1e-6 on expert OTHER: chosen over expert TIED wherever only one of them is."""
    from edgelin.exporters import export

    model = tiny_moe_lm()
    out = tmp_path_factory.mktemp("moe-aside") / "export"
    export(copy.deepcopy(model), out, check=False)
    nudged = copy.deepcopy(model)
    with torch.no_grad():
        moe_layers(nudged)[0].expert_bias[OTHER] = 1e-6
    return out, model, nudged


def test_flips_are_reported_and_set_aside(export_and_nudged):
    from edgelin.validate import validate

    out, _, nudged = export_and_nudged
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 200))
    chosen = reference_routing(nudged, ids)[0]
    flips = np.mean(np.any(chosen == OTHER, -1) & ~np.any(chosen == TIED, -1))
    assert 0.02 < flips < 0.7, flips  # the crafted near tie decides some tokens, not all

    report = validate(out, nudged, steps=24, long=0, kv=(), upstream="off")
    checks = {c.group: [x for x in report.checks if x.group == c.group] for c in report.checks}
    (routing,) = checks["routing"]
    assert "routing agreement 100.00%" not in routing.name, routing  # the flips are reported, never hidden
    prefill = checks["prefill"]
    assert any("set aside" in c.name for c in prefill), [c.name for c in prefill]
    assert all(c.status == "pass" for c in prefill), report.table()  # the other tokens held to the fp32 budget
    (decode,) = checks["decode"]
    assert "set aside" in decode.name and decode.status == "pass", report.table()
    assert [c.status for c in checks["structure"] if c.name == "source weights"] == ["fail"]  # not the exported weights


def test_the_tokens_set_aside_are_far_off(export_and_nudged):
    """Without setting them aside the prefill would fail: at the flipped tokens the logits differ by another
    expert's output, far beyond fp32 rounding."""
    from edgelin.runtime import load

    out, _, nudged = export_and_nudged
    ids = np.random.default_rng(1).integers(0, VOCAB, (2, 120))
    session = load(out)
    got = session.prefill(ids, session.new_state(2))
    with torch.no_grad():
        want = nudged(torch.from_numpy(ids))[0].numpy()
    err = np.abs(got - want).max(-1)  # [B, T]
    chosen = reference_routing(nudged, ids)[0].reshape(2, 120, 2)
    other = np.any(chosen == OTHER, -1) & ~np.any(chosen == TIED, -1)  # the nudged reference took OTHER, the export TIED
    assert other.any() and (~other).any()
    assert err[other].min() > 1e-2 and err[~other].max() < 1e-4, (err[other].min(), err[~other].max())
