"""fla hybrids: GLA, RetNet and Gated DeltaNet checkpoints whose ``attn`` field puts fla's softmax ``Attention`` at chosen layers.

The oracle is fla's own model: its whole forward runs (its linear layers' real kernels in Triton's interpreter, its
Attention layer's projections, RoPE, cache updates and window truncation), except ``flash_attn_func``, which needs a
GPU: it is replaced by ``flash_attn_stand_in`` below, a float64 softmax attention written from flash-attn's
documented semantics (causal mask aligned bottom-right, ``window_size=(W - 1, 0)`` keeps W keys per query, grouped
heads, scale D^-0.5). The import must match fla's logits over a prefill and cached decode steps, its KV cache must
hold fla's keys (after RoPE) and values, and one hybrid exports, validates and generates.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from edgelin.errors import CheckpointError
from edgelin.importers import import_checkpoint
from testkit import max_abs

MAX_ABS = 1e-4
BATCH, PROMPT, STEPS = 2, 40, 8


def flash_attn_stand_in(q, k, v, causal=True, window_size=(-1, -1), softmax_scale=None, **_):
    """flash_attn_func on CPU: q [B, Tq, H, D], k, v [B, Tk, Hkv, D] -> [B, Tq, H, D], in float64."""
    assert causal and window_size[1] in (-1, 0)
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    scale = D**-0.5 if softmax_scale is None else softmax_scale
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))  # [B, h, T, D]
    kd, vd = kd.repeat_interleave(H // Hkv, dim=1), vd.repeat_interleave(H // Hkv, dim=1)
    i = torch.arange(Tq)[:, None] + (Tk - Tq)  # the key position each query sits at (bottom-right aligned)
    j = torch.arange(Tk)[None, :]
    mask = j <= i
    if window_size[0] >= 0:
        mask &= j >= i - window_size[0]
    scores = (qd @ kd.transpose(-1, -2)) * scale
    out = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ vd
    return out.transpose(1, 2).to(q.dtype)


@pytest.fixture(scope="module")
def fla_attention(fla_oracle):
    """fla with its Attention's flash_attn_func replaced by the stand-in (for building and running fla's models)."""
    import fla.layers.attn as attn

    before = attn.flash_attn_func
    attn.flash_attn_func = flash_attn_stand_in
    yield fla_oracle
    attn.flash_attn_func = before


CASES = {
    "gla-attn13-gqa": ("gla", {"num_hidden_layers": 4, "attn": {"layers": [1, 3], "num_heads": 4, "num_kv_heads": 2}}),
    "gla-attn0-window6-bias-theta": (
        "gla", {"num_hidden_layers": 2, "attn": {"layers": [0], "num_heads": 2, "window_size": 6, "qkv_bias": True, "rope_theta": 500.0}},
    ),
    "gated_deltanet-attn1-gva": (
        "gated_deltanet", {
            "num_hidden_layers": 2, "head_dim": 16, "num_heads": 2, "num_v_heads": 4, "expand_v": 1.0,
            "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2},
        },
    ),
    "retnet-attn-list": (
        "retnet", {"num_hidden_layers": 3, "attn": [{"layers": [0], "num_heads": 4}, {"layers": [2], "num_heads": 2, "window_size": 9}]},
    ),
}
_RESULTS: dict = {}


def case(case_id, fla_attention, tmp_path_factory):
    model_type, options = CASES[case_id]
    return fla_attention.cached_case(_RESULTS, case_id, model_type, options, tmp_path_factory, batch=BATCH, prompt=PROMPT, steps=STEPS)


@pytest.mark.parametrize("case_id", [pytest.param(c, marks=pytest.mark.xdist_group("fla-hybrid")) for c in CASES])
def test_hybrid_import_matches_fla(case_id, fla_attention, tmp_path_factory):
    folder, prompt, steps, (ref_prefill, ref_decode, ref_cache) = case(case_id, fla_attention, tmp_path_factory)
    model, state = fla_attention.import_vs_fla(folder, prompt, steps, ref_prefill, ref_decode, MAX_ABS)
    spec = json.loads((folder / "config.json").read_text())["attn"]
    specs = [spec] if isinstance(spec, dict) else spec
    for s in specs:
        for layer in s["layers"]:
            assert model.blocks[layer].attn.kind == "attention"
            keys, values = ref_cache[layer]["attn_state"]  # fla: [B, T, Hkv * D], keys after RoPE
            window = s.get("window_size")
            held = PROMPT + STEPS if window is None else window
            mine_k, mine_v = state[f"{layer}.key"], state[f"{layer}.value"]  # [B, Hkv, P, D]
            assert mine_k.shape[2] == held
            B, P, _ = keys.shape
            as_fla = lambda t: t.transpose(1, 2).reshape(B, t.shape[2], -1)  # noqa: E731
            assert max_abs(as_fla(mine_k), keys[:, -held:]) < 1e-4 and max_abs(as_fla(mine_v), values[:, -held:]) < 1e-4
            assert state[f"{layer}.pos"].tolist() == [PROMPT + STEPS] * BATCH
    assert model.max_positions == 2048  # fla's default max_position_embeddings: declared as the context limit


def test_fla_hybrid_exports_validates_and_generates(fla_attention, tmp_path_factory, export_of):
    """The done-when case: an fla GLA with attn at layers [1, 3] exports, validates and generates."""
    import edgelin.runtime as rt
    from edgelin.validate import validate

    folder, *_ = case("gla-attn13-gqa", fla_attention, tmp_path_factory)
    out = export_of(folder, {"test_fla_hybrid": "gla-attn13-gqa"}, label="fla-hybrid")
    report = validate(out, folder, steps=16, upstream="off")  # fla's run: test_upstream.py (not of a hybrid)
    assert report.passed, report.table()
    result = rt.generate_text(rt.load(out, provider="cpu"), prompt_ids=[1, 2, 3], max_new_tokens=5, min_new_tokens=5)
    assert len(result["ids"]) == 5


def edited(folder, tmp_path, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "model.safetensors").symlink_to(folder / "model.safetensors")
    return out


@pytest.mark.parametrize("attn, fragment", [
    ({"layers": [1], "num_heads": 3}, "does not divide hidden_size"),
    ({"layers": [1], "num_heads": 4, "num_kv_heads": 3}, "does not divide num_heads"),
    ({"layers": [9], "num_heads": 4}, "lists layers"),
    ({"layers": [1], "num_heads": 4, "window_size": 4096}, "larger than max_position_embeddings"),
    ({"layers": [1], "num_heads": 4, "qk_norm": True}, "'qk_norm'"),
    ("all", "must be an object"),
])
def test_bad_attn_fields_are_refused_by_name(attn, fragment, fla_attention, tmp_path_factory, tmp_path):
    folder, *_ = case("gla-attn13-gqa", fla_attention, tmp_path_factory)
    with pytest.raises(CheckpointError, match="'attn'") as info:
        import_checkpoint(edited(folder, tmp_path, attn=attn))
    assert fragment in str(info.value)
